/*
 * nodeplug CNI fast path: the launcher's thick-mode client, in C.
 *
 * Starting even the frozen Python entry point costs more than the whole ADD the warm agent performs, and the
 * runtime execs the plugin for every pod sandbox. So the launcher hands the invocation to the agent itself, with
 * cni/thick.py's binary framing (constants in the generated protocol.h): a header, the CNI_* variables as NUL-ended
 * KEY=VALUE entries and stdin as it came; then ACK, GO, and the reply (exit status, length, stdout), whose stdout is
 * written out unchanged. It reads and writes no JSON: the network config travels as opaque bytes.
 *
 * Not reading the config, it cannot know the socket the config names: it asks the agent at $NODEPLUG_CNI_SOCKET, else
 * at the socket `nodeplug install-cni` recorded for the conflist it wrote (the file NP_SOCKET_RECORD in nodeplug.d/,
 * beside the bundles: one absolute path, written atomically), else at the default socket; that agent answers NOT_HERE
 * for a config naming another one. Whenever the agent does not answer, the Python entry point takes over, told
 * through the environment what happened so that no agent is asked twice or waited for twice:
 *
 *   nobody serves the socket, refuses, or closes before ACK   NODEPLUG_CNI_AGENT_TRIED=<socket>
 *   NOT_HERE                                                  nothing: Python asks the socket the config names
 *   NAK (a request larger than that agent takes, which it     nothing: Python asks the socket the config names (the
 *   refuses before it has read which socket it names)         same agent answers NAK again, another agent or the
 *                                                             standalone path does the work)
 *   no ACK within the launcher's wait                         the connection itself, kept open across exec:
 *                                                             NODEPLUG_CNI_AGENT_FD, _WAITED (seconds), _TRIED;
 *                                                             Python waits out the rest of the config's agentTimeout
 *   the agent took the request (GO sent) and then failed      NODEPLUG_CNI_AGENT_LOST=<why>: Python prints code 11
 *                                                             (try again later) rather than redo half-done work
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fastpath.h"
#include "protocol.h"

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put_u32(unsigned char *p, size_t v) {
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16), p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* The request: MAGIC, u32 env block length, u32 stdin length, the env block, stdin. NULL when it cannot be made. */
static unsigned char *request(char **envp, const char *in, size_t n, size_t *size) {
    size_t env = 0;
    for (char **e = envp; *e != NULL; e++)
        if (strncmp(*e, "CNI_", 4) == 0 && strchr(*e, '=') != NULL) env += strlen(*e) + 1;
    if (env > UINT32_MAX || n > UINT32_MAX) return NULL;
    *size = NP_MAGIC_LEN + 8 + env + n;
    unsigned char *buf = malloc(*size ? *size : 1);
    if (buf == NULL) return NULL;
    memcpy(buf, NP_MAGIC, NP_MAGIC_LEN);
    put_u32(buf + NP_MAGIC_LEN, env);
    put_u32(buf + NP_MAGIC_LEN + 4, n);
    unsigned char *p = buf + NP_MAGIC_LEN + 8;
    for (char **e = envp; *e != NULL; e++) {
        if (strncmp(*e, "CNI_", 4) != 0 || strchr(*e, '=') == NULL) continue;
        size_t len = strlen(*e) + 1; /* with its NUL */
        memcpy(p, *e, len);
        p += len;
    }
    if (n) memcpy(p, in, n);
    return buf;
}

static int send_all(int fd, const unsigned char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        p += w;
        n -= (size_t)w;
    }
    return 1;
}

/* Reads exactly n bytes, waiting at most until deadline (ms, CLOCK_MONOTONIC). 1 done, 0 closed or failed, -1 timed
 * out. */
static int recv_all(int fd, unsigned char *p, size_t n, long long deadline) {
    while (n > 0) {
        long long left = deadline - now_ms();
        if (left <= 0) return -1;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, left > 0x7fffffff ? 0x7fffffff : (int)left);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return 0;
        if (r == 0) return -1;
        ssize_t got = recv(fd, p, n, 0);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (got <= 0) return 0;
        p += got;
        n -= (size_t)got;
    }
    return 1;
}

static void note(const char *name, const char *value) {
    if (setenv(name, value, 1) != 0) unsetenv(name);
}

/* The agent took the request and failed before answering: Python prints code 11 with the config's cniVersion. */
static void lost(const char *path, const char *why) {
    char text[256 + sizeof(((struct sockaddr_un *)0)->sun_path)];
    snprintf(text, sizeof text, "the agent at %s %s", path, why);
    note(NP_ENV_AGENT_LOST, text);
}

/* Reads a reply (after GO, or after NAK) and, when it is whole, writes its stdout and exits with its status. */
static void answer(int fd, const char *path, int after_go) {
    unsigned char head[5];
    long long deadline = now_ms() + NP_REPLY_TIMEOUT_MS;
    size_t size = 0;
    int r = recv_all(fd, head, sizeof head, deadline);
    if (r == 1) size = ((size_t)head[1] << 24) | ((size_t)head[2] << 16) | ((size_t)head[3] << 8) | head[4];
    if (r == 1 && (head[0] > 1 || size > NP_MAX_REPLY)) r = 0; /* exit status 0 or 1, whatever the peer sends */
    unsigned char *out = r == 1 ? malloc(size ? size : 1) : NULL;
    if (r == 1 && out == NULL) r = 0;
    if (r == 1) r = recv_all(fd, out, size, deadline);
    if (r != 1) {
        free(out);
        if (after_go) lost(path, r < 0 ? "did not answer in time" : "failed before answering: connection closed or "
                                                                     "malformed answer");
        return;
    }
    close(fd);
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(1, out + off, size - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        off += (size_t)w;
    }
    exit(head[0]);
}

/* The socket install-cni recorded in <dir>/../NP_SOCKET_RECORD: an absolute path on one line (a trailing newline is
 * allowed), shorter than sun_path, without NUL bytes. NULL when there is no such record or it is not one. */
static const char *recorded_socket(const char *dir, char *buf, size_t size) {
    char file[PATH_MAX];
    if (snprintf(file, sizeof file, "%s/../%s", dir, NP_SOCKET_RECORD) >= (int)sizeof file) return NULL;
    int fd = open(file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return NULL;
    ssize_t got = read(fd, buf, size);
    close(fd);
    if (got <= 0 || (size_t)got >= size) return NULL; /* empty, unreadable, or longer than any socket path */
    if (buf[got - 1] == '\n') got--;
    buf[got] = '\0';
    if (buf[0] != '/' || memchr(buf, '\0', (size_t)got) != NULL || strchr(buf, '\n') != NULL) return NULL;
    return buf;
}

void nodeplug_fastpath(char **envp, const char *in, size_t n, const char *dir) {
    const char *path = getenv(NP_ENV_SOCKET);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    char recorded[sizeof addr.sun_path + 2]; /* room for the newline; a path too long for sun_path is refused below */
    if (path == NULL || path[0] != '/') path = recorded_socket(dir, recorded, sizeof recorded);
    if (path == NULL) path = NP_DEFAULT_SOCKET;
    if (strlen(path) >= sizeof addr.sun_path) return; /* nobody can serve it; Python says what the config names */
    memcpy(addr.sun_path, path, strlen(path) + 1);

    size_t size;
    unsigned char *req = request(envp, in, n, &size);
    if (req == NULL) return;
    long long started = now_ms();
    long long deadline = started + NP_ACK_WAIT_MS;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        free(req);
        return;
    }
    struct timeval tv = {NP_ACK_WAIT_MS / 1000, (NP_ACK_WAIT_MS % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv); /* bounds connect and send on a full peer */
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        free(req);
        close(fd);
        note(NP_ENV_AGENT_TRIED, path); /* absent or refusing: the Python entry point does not ask it again */
        return;
    }
    send_all(fd, req, size); /* a failure here still lets an answer already sent (NAK) be read */
    free(req);

    unsigned char first = 0;
    int r = recv_all(fd, &first, 1, deadline);
    if (r == 1 && first == NP_ACK) {
        unsigned char go = NP_GO;
        if (!send_all(fd, &go, 1)) r = 0; /* the agent never had GO: it runs nothing */
    }
    if (r == 1 && first == NP_ACK) {
        answer(fd, path, 1); /* GO is sent: from here on the agent owns the request */
        close(fd);
        return;
    }
    if (r == 1 && (first == NP_NOT_HERE || first == NP_NAK)) { /* NAK: refused unread, perhaps not its request */
        close(fd);
        return;
    }
    if (r < 0) { /* no ACK yet: hand the connection on; Python waits for the rest of the config's agentTimeout */
        char text[32];
        if (fcntl(fd, F_SETFD, 0) == 0) {
            snprintf(text, sizeof text, "%d", fd);
            note(NP_ENV_AGENT_FD, text);
            snprintf(text, sizeof text, "%.3f", (double)(now_ms() - started) / 1000.0);
            note(NP_ENV_AGENT_WAITED, text);
            note(NP_ENV_AGENT_TRIED, path);
            return;
        }
    }
    close(fd);
    note(NP_ENV_AGENT_TRIED, path); /* closed, or not speaking this protocol */
}
