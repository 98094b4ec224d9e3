/*
 * nodeplug CNI launcher: the program a container runtime execs as /opt/cni/bin/nodeplug.
 *
 * Container hosts often have no Python and may have an older glibc or none, so the CNI entry point ships as a
 * self-contained bundle (scripts/build-cni-bundle):
 *
 *     <dir>/nodeplug        this launcher, linked statically: it needs nothing from the host
 *     <dir>/nodeplug-cni    the frozen entry point (cni.entry:main, a PyInstaller one-dir build)
 *     <dir>/_internal/      its Python, modules and libraries, plus the glibc it was built with: the dynamic
 *                           loader under its own file name (e.g. ld-linux-x86-64.so.2; the frozen program
 *                           recognises a loader by that name) and glibc's libraries
 *
 * What it does itself, without starting Python:
 *
 *   VERSION   prints the one answer cni/versions.py gives (generated into protocol.h);
 *   others    reads stdin (at most NP_MAX_STDIN bytes) and hands the invocation to the warm agent (fastpath.c), at
 *             the socket install-cni recorded beside the bundles (<dir>/../NP_SOCKET_RECORD) for the conflist it wrote.
 *
 * Otherwise (no agent, a config for another agent's socket, NODEPLUG_CNI_STANDALONE set, no CNI_COMMAND) it replaces
 * itself with the entry point, giving it back exactly the stdin it read (a memory file) or, when it read none, the
 * stdin it was given:
 *
 *     <dir>/_internal/LOADER --library-path <dir>/_internal --argv0 <dir>/nodeplug-cni <dir>/nodeplug-cni ARGS...
 *
 * so the entry point runs on the bundle's own loader and libc whatever the host has. (The frozen program then
 * restarts itself once through /proc/self/exe, the same loader, with LD_LIBRARY_PATH=<dir>/_internal; the entry
 * point restores the caller's LD_LIBRARY_PATH before it runs any host command.) Environment, stdout, the working
 * directory and the exit status pass through unchanged; what the launcher learnt on the way is added to the
 * environment (see fastpath.c). Stdin that could not be read whole (too large, a read error, no memory) is never
 * replayed in part: the entry point is told why and answers with the spec's error. Only when the bundle itself is
 * broken does the launcher print an answer of its own: the error generated into protocol.h, with the file at fault
 * on stderr.
 */
#define _GNU_SOURCE /* memfd_create */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fastpath.h"
#include "protocol.h"

#ifndef NODEPLUG_LOADER
#error "build with -DNODEPLUG_LOADER='\"ld-linux-x86-64.so.2\"' (the file name of the bundled glibc loader)"
#endif

static void fail(const char *what, const char *path, int err) {
    fprintf(stderr, "nodeplug: the CNI bundle cannot start: %s %s: %s\n", what, path, strerror(err));
    fputs(NP_BUNDLE_BROKEN, stdout);
    fflush(stdout);
    exit(1);
}

/* The directory holding this executable, symlinks resolved: /proc/self/exe, else realpath(argv[0]). */
static void own_dir(const char *argv0, char *dir, size_t size) {
    char path[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
    if (n > 0) {
        path[n] = '\0';
    } else if (argv0 == NULL || strchr(argv0, '/') == NULL || realpath(argv0, path) == NULL) {
        fail("cannot find its own directory from", argv0 ? argv0 : "(no argv[0])", n < 0 ? errno : ENOENT);
    }
    char *slash = strrchr(path, '/');
    if (slash == NULL) fail("cannot find its own directory from", path, ENOENT);
    *slash = '\0';
    if (snprintf(dir, size, "%s", path[0] ? path : "/") >= (int)size) fail("path too long:", path, ENAMETOOLONG);
}

/* Replaces this process with the frozen entry point. */
static void run_entry(int argc, char **argv) {
    char dir[PATH_MAX], loader[PATH_MAX], libpath[PATH_MAX], app[PATH_MAX];
    own_dir(argc > 0 ? argv[0] : NULL, dir, sizeof dir);
    if (snprintf(loader, sizeof loader, "%s/_internal/%s", dir, NODEPLUG_LOADER) >= (int)sizeof loader ||
        snprintf(app, sizeof app, "%s/nodeplug-cni", dir) >= (int)sizeof app ||
        snprintf(libpath, sizeof libpath, "%s/_internal", dir) >= (int)sizeof libpath) {
        fail("path too long:", dir, ENAMETOOLONG);
    }
    char **args = calloc((size_t)argc + 7, sizeof *args);
    if (args == NULL) fail("out of memory in", dir, ENOMEM);
    int i = 0;
    args[i++] = loader;
    args[i++] = "--library-path";
    args[i++] = libpath;
    args[i++] = "--argv0";
    args[i++] = app;
    args[i++] = app;
    for (int k = 1; k < argc; k++) args[i++] = argv[k];
    args[i] = NULL;
    execv(loader, args);
    fail("cannot execute", loader, errno);
}

/* Reads all of stdin into *data (at most NP_MAX_STDIN bytes). NULL on success, else why it could not. */
static const char *read_stdin(char **data, size_t *len) {
    size_t cap = 0;
    *data = NULL;
    *len = 0;
    for (;;) {
        if (*len == cap) {
            if (cap > NP_MAX_STDIN) return "too large";
            size_t next = cap ? cap * 2 : 16384;
            if (next > (size_t)NP_MAX_STDIN + 1) next = (size_t)NP_MAX_STDIN + 1;
            char *d = realloc(*data, next);
            if (d == NULL) return "out of memory";
            *data = d, cap = next;
        }
        ssize_t r = read(0, *data + *len, cap - *len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return strerror(errno);
        if (r == 0) return *len > NP_MAX_STDIN ? "too large" : NULL;
        *len += (size_t)r;
    }
}

/* Makes fd 0 read back exactly the bytes read from it (a memory file). 0 when that is impossible. */
static int replay_stdin(const char *data, size_t len) {
    int fd = memfd_create("nodeplug-cni-stdin", MFD_CLOEXEC);
    if (fd < 0) return 0;
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, data + off, len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            close(fd);
            return 0;
        }
        off += (size_t)w;
    }
    int ok = lseek(fd, 0, SEEK_SET) == 0 && dup2(fd, 0) == 0; /* dup2 clears close-on-exec on fd 0 */
    close(fd);
    return ok;
}

int main(int argc, char **argv, char **envp) {
    const char *command = getenv("CNI_COMMAND");
    const char *standalone = getenv("NODEPLUG_CNI_STANDALONE");
    if (command == NULL || command[0] == '\0') run_entry(argc, argv); /* Python names what is missing */
    if (strcmp(command, "VERSION") == 0) {
        char buf[65536]; /* the caller's config does not change the answer; read it so the caller's write succeeds */
        while (read(0, buf, sizeof buf) > 0) {
        }
        fputs(NP_VERSION_ANSWER, stdout);
        fflush(stdout);
        return 0;
    }
    if (standalone != NULL && standalone[0] != '\0' && strcmp(standalone, "0") != 0) run_entry(argc, argv);

    char *data;
    size_t len;
    const char *failed = read_stdin(&data, &len);
    if (failed == NULL) {
        char dir[PATH_MAX];
        own_dir(argc > 0 ? argv[0] : NULL, dir, sizeof dir);
        nodeplug_fastpath(envp, data, len, dir); /* returns when the entry point must run */
        if (!replay_stdin(data, len)) failed = "cannot hand the network config on (memfd_create failed)";
    }
    if (failed != NULL && setenv(NP_ENV_STDIN_FAILED, failed, 1) != 0) fail("cannot set", NP_ENV_STDIN_FAILED, errno);
    run_entry(argc, argv);
    return 1;
}
