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
 * First the launcher tries its fast path (fastpath.c): VERSION, and handing the invocation to the warm agent over
 * the thick-mode socket, both without starting Python. When that does not apply (no agent, an unusual config) it
 * puts back what it read from stdin and finds <dir> (the directory it really lives in, symlinks resolved), then
 * replaces itself with
 *
 *     <dir>/_internal/LOADER --library-path <dir>/_internal --argv0 <dir>/nodeplug-cni <dir>/nodeplug-cni ARGS...
 *
 * so the entry point runs on the bundle's own loader and libc whatever the host has. (The frozen program then
 * restarts itself once through /proc/self/exe, the same loader, with LD_LIBRARY_PATH=<dir>/_internal; the entry
 * point restores the caller's LD_LIBRARY_PATH before it runs any host command.) Environment, stdin, stdout, the
 * working directory and the exit status pass through unchanged. If the bundle is broken the launcher prints a CNI
 * error (JSON on stdout, as the spec asks) naming the file at fault, and exits 1.
 */
#define _GNU_SOURCE /* memfd_create */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fastpath.h"

#ifndef NODEPLUG_LOADER
#error "build with -DNODEPLUG_LOADER='\"ld-linux-x86-64.so.2\"' (the file name of the bundled glibc loader)"
#endif

static void fail(const char *what, const char *path, int err) {
    /* The message goes into JSON: paths come from this bundle and contain no quotes or backslashes. */
    printf("{\"cniVersion\":\"1.0.0\",\"code\":999,\"msg\":\"nodeplug: the CNI bundle cannot start\","
           "\"details\":\"%s %s: %s (reinstall it with: nodeplug install-cni)\"}\n",
           what, path, strerror(err));
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

/* Make fd 0 read back exactly the bytes the fast path consumed (a memory file; a pipe if that is unavailable). */
static void replay_stdin(const struct stdin_copy *in) {
    int fd = memfd_create("nodeplug-cni-stdin", 0);
    if (fd >= 0) {
        size_t off = 0;
        while (off < in->len) {
            ssize_t w = write(fd, in->data + off, in->len - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) fail("cannot replay stdin into", "a memory file", errno);
            off += (size_t)w;
        }
        if (lseek(fd, 0, SEEK_SET) != 0 || dup2(fd, 0) != 0) fail("cannot replay stdin from", "a memory file", errno);
        close(fd);
        return;
    }
    int p[2];
    if (in->len > 65536 || pipe(p) != 0) fail("cannot replay stdin:", "memfd_create and pipe failed", errno);
    if (in->len && write(p[1], in->data, in->len) != (ssize_t)in->len) fail("cannot replay stdin:", "pipe", errno);
    close(p[1]);
    if (dup2(p[0], 0) != 0) fail("cannot replay stdin:", "dup2", errno);
    close(p[0]);
}

int main(int argc, char **argv, char **envp) {
    char dir[PATH_MAX], loader[PATH_MAX], libpath[PATH_MAX], app[PATH_MAX];
    struct stdin_copy in = {0};
    nodeplug_fastpath(envp, &in);
    if (in.taken && !in.read_failed) replay_stdin(&in);
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
    return 1;
}
