/*
 * nodeplug CNI fast path: the launcher's thick-mode client, in C.
 *
 * Starting even the frozen Python entry point costs more than the whole ADD the warm agent performs, and the
 * runtime execs the plugin for every pod sandbox (and VERSION before most calls). So the launcher first tries to do
 * the entry point's job itself, for the cases that need no Python at all:
 *
 *   VERSION   answered here, exactly as cni/versions.py answers it (a test compares the two);
 *   others    forwarded to the agent over the thick-mode socket with cni/thick.py's protocol (4-byte big-endian
 *             length + JSON frame {"env", "stdin"}; ACK; GO; frame {"exit", "stdout"}), and the agent's answer
 *             printed verbatim with its exit status.
 *
 * Whenever anything is unusual the fast path steps aside and the Python entry point runs with the same stdin
 * (replayed by the caller): the agent absent or not acknowledging in time (it then does the work standalone), a
 * config that is not plain ASCII JSON or whose socket/agentTimeout fields need interpreting, NODEPLUG_CNI_STANDALONE
 * set, no CNI_COMMAND. Python then produces the precise answer or error. The one case handled here that Python
 * would also handle without the agent is the agent failing *after* it took the request (GO sent): like cni/entry.py
 * this prints error 11 (try again later) rather than redo half-done work.
 */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "fastpath.h"

#define MAX_FRAME (1u << 20)
#define DEFAULT_SOCKET "/run/nodeplug/cni.sock"
#define DEFAULT_AGENT_TIMEOUT 2.0
#define REPLY_TIMEOUT 300.0
#define ACK 0x06
#define GO 0x07

static const char *const SUPPORTED[] = {"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"};
#define LATEST "1.1.0"

/* ------------------------------------------------------------------ growable byte buffer */

struct buf {
    char *data;
    size_t len, cap;
    int oom;
};

static void put(struct buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap) cap *= 2;
        char *d = realloc(b->data, cap);
        if (d == NULL) {
            b->oom = 1;
            return;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

/* A JSON string of ASCII text (the callers check it is ASCII). */
static void put_json_string(struct buf *b, const char *s, size_t n) {
    put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char esc[2] = {'\\', (char)c};
            put(b, esc, 2);
        } else if (c < 0x20) {
            char esc[8];
            snprintf(esc, sizeof esc, "\\u%04x", c);
            put(b, esc, 6);
        } else {
            put(b, (const char *)&s[i], 1);
        }
    }
    put(b, "\"", 1);
}

/* ------------------------------------------------------------------ a strict JSON scanner
 *
 * Validates a whole document and reports, for the top-level object, the keys the entry point reads. Strings with
 * escapes are accepted as valid but reported as "needs interpreting" (the fast path then steps aside).
 */

struct scan {
    const char *p, *end;
    int depth;
};

struct value {          /* a scanned value: where it is and what it is */
    const char *start;  /* first byte */
    size_t len;         /* bytes */
    char kind;          /* 's' string, 'n' number, 'o' object, 'a' array, 't' true, 'f' false, 'z' null */
    int escaped;        /* string with a backslash escape in it */
};

static void ws(struct scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static int is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

static int scan_value(struct scan *s, struct value *v);

static int scan_string(struct scan *s, struct value *v) {
    v->kind = 's';
    v->escaped = 0;
    s->p++; /* opening quote */
    v->start = s->p;
    while (s->p < s->end) {
        unsigned char c = (unsigned char)*s->p;
        if (c == '"') {
            v->len = (size_t)(s->p - v->start);
            s->p++;
            return 1;
        }
        if (c < 0x20) return 0;
        if (c == '\\') {
            v->escaped = 1;
            if (++s->p >= s->end) return 0;
            char e = *s->p;
            if (e == 'u') {
                if (s->end - s->p < 5) return 0;
                for (int i = 1; i <= 4; i++)
                    if (!is_hex(s->p[i])) return 0;
                s->p += 4;
            } else if (!strchr("\"\\/bfnrt", e)) {
                return 0;
            }
        }
        s->p++;
    }
    return 0;
}

static int scan_number(struct scan *s, struct value *v) {
    const char *p = s->p;
    v->kind = 'n';
    v->start = p;
    if (p < s->end && *p == '-') p++;
    if (p >= s->end) return 0;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < s->end && *p >= '0' && *p <= '9') p++;
    } else {
        return 0;
    }
    if (p < s->end && *p == '.') {
        p++;
        if (p >= s->end || *p < '0' || *p > '9') return 0;
        while (p < s->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < s->end && (*p == '+' || *p == '-')) p++;
        if (p >= s->end || *p < '0' || *p > '9') return 0;
        while (p < s->end && *p >= '0' && *p <= '9') p++;
    }
    v->len = (size_t)(p - s->p);
    s->p = p;
    return 1;
}

static int scan_word(struct scan *s, struct value *v, const char *word, char kind) {
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0) return 0;
    v->kind = kind;
    v->start = s->p;
    v->len = n;
    s->p += n;
    return 1;
}

/* Calls on_member(key, value, ctx) for each member when on_member is set (top level only). */
typedef void (*member_fn)(const struct value *key, const struct value *val, void *ctx);

static int scan_object(struct scan *s, struct value *v, member_fn on_member, void *ctx) {
    v->kind = 'o';
    v->start = s->p;
    s->p++;
    ws(s);
    if (s->p < s->end && *s->p == '}') {
        s->p++;
        v->len = (size_t)(s->p - v->start);
        return 1;
    }
    for (;;) {
        struct value key, val;
        ws(s);
        if (s->p >= s->end || *s->p != '"' || !scan_string(s, &key)) return 0;
        ws(s);
        if (s->p >= s->end || *s->p != ':') return 0;
        s->p++;
        if (!scan_value(s, &val)) return 0;
        if (on_member) on_member(&key, &val, ctx);
        ws(s);
        if (s->p < s->end && *s->p == ',') {
            s->p++;
            continue;
        }
        if (s->p < s->end && *s->p == '}') {
            s->p++;
            v->len = (size_t)(s->p - v->start);
            return 1;
        }
        return 0;
    }
}

static int scan_array(struct scan *s, struct value *v) {
    v->kind = 'a';
    v->start = s->p;
    s->p++;
    ws(s);
    if (s->p < s->end && *s->p == ']') {
        s->p++;
        v->len = (size_t)(s->p - v->start);
        return 1;
    }
    for (;;) {
        struct value item;
        if (!scan_value(s, &item)) return 0;
        ws(s);
        if (s->p < s->end && *s->p == ',') {
            s->p++;
            continue;
        }
        if (s->p < s->end && *s->p == ']') {
            s->p++;
            v->len = (size_t)(s->p - v->start);
            return 1;
        }
        return 0;
    }
}

static int scan_value(struct scan *s, struct value *v) {
    ws(s);
    if (s->p >= s->end || ++s->depth > 200) return 0;
    int ok;
    switch (*s->p) {
        case '{': ok = scan_object(s, v, NULL, NULL); break;
        case '[': ok = scan_array(s, v); break;
        case '"': ok = scan_string(s, v); break;
        case 't': ok = scan_word(s, v, "true", 't'); break;
        case 'f': ok = scan_word(s, v, "false", 'f'); break;
        case 'n': ok = scan_word(s, v, "null", 'z'); break;
        default: ok = scan_number(s, v); break;
    }
    s->depth--;
    return ok;
}

static int key_is(const struct value *key, const char *name) {
    return !key->escaped && key->len == strlen(name) && memcmp(key->start, name, key->len) == 0;
}

/* ------------------------------------------------------------------ what the entry point reads from the config */

struct conf {
    struct value socket, ipam_socket, timeout, version;
    int has_socket, has_ipam_socket, has_timeout, has_version;
};

static void ipam_member(const struct value *key, const struct value *val, void *ctx) {
    struct conf *c = ctx;
    if (key_is(key, "socket")) c->ipam_socket = *val, c->has_ipam_socket = 1;
}

static void top_member(const struct value *key, const struct value *val, void *ctx) {
    struct conf *c = ctx;
    /* later duplicates win, as in Python's dict */
    if (key_is(key, "socket")) {
        c->socket = *val, c->has_socket = 1;
    } else if (key_is(key, "agentTimeout")) {
        c->timeout = *val, c->has_timeout = 1;
    } else if (key_is(key, "cniVersion")) {
        c->version = *val, c->has_version = 1;
    } else if (key_is(key, "ipam")) {
        c->has_ipam_socket = 0;
        if (val->kind == 'o') {
            struct scan s = {val->start, val->start + val->len, 0};
            struct value ignored;
            scan_object(&s, &ignored, ipam_member, c);
        }
    }
}

/* 1: a whole JSON document that is an object (members reported); 0: anything else */
static int scan_config(const char *text, size_t n, struct conf *c) {
    struct scan s = {text, text + n, 0};
    struct value top;
    memset(c, 0, sizeof *c);
    ws(&s);
    if (s.p >= s.end || *s.p != '{') return 0;
    if (!scan_object(&s, &top, top_member, c)) return 0;
    ws(&s);
    return s.p == s.end;
}

/* ------------------------------------------------------------------ VERSION */

/* Prints the answer and exits; returns only when the version string needs Python to decode it. */
static void answer_version(const char *in, size_t n) {
    const char *current = LATEST;
    struct conf c;
    size_t i = 0;
    while (i < n && strchr(" \t\n\r", in[i])) i++;
    if (i < n && scan_config(in, n, &c) && c.has_version && c.version.kind == 's') {
        if (c.version.escaped) return; /* Python decodes the escapes and answers */
        for (size_t k = 0; k < sizeof SUPPORTED / sizeof *SUPPORTED; k++) {
            if (c.version.len == strlen(SUPPORTED[k]) && memcmp(c.version.start, SUPPORTED[k], c.version.len) == 0)
                current = SUPPORTED[k];
        }
    }
    printf("{\"cniVersion\":\"%s\",\"supportedVersions\":[", current);
    for (size_t k = 0; k < sizeof SUPPORTED / sizeof *SUPPORTED; k++) printf("%s\"%s\"", k ? "," : "", SUPPORTED[k]);
    printf("]}");
    fflush(stdout);
    exit(0);
}

/* ------------------------------------------------------------------ the agent */

static void set_timeout(int fd, double seconds) {
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

static int send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        p += w;
        n -= (size_t)w;
    }
    return 1;
}

static int recv_all(int fd, char *p, size_t n) {
    while (n > 0) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;
        p += r;
        n -= (size_t)r;
    }
    return 1;
}

/* Appends the UTF-8 encoding of code point cp. */
static void put_utf8(struct buf *b, unsigned long cp) {
    char out[4];
    size_t n;
    if (cp < 0x80) {
        out[0] = (char)cp, n = 1;
    } else if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
    } else if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12)), out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
    } else {
        out[0] = (char)(0xF0 | (cp >> 18)), out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), out[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
    }
    put(b, out, n);
}

static unsigned long hex4(const char *p) { return strtoul((char[5]){p[0], p[1], p[2], p[3], 0}, NULL, 16); }

/* The text of a scanned JSON string, escapes decoded to UTF-8 (lone surrogates become U+FFFD). */
static void unescape(const struct value *v, struct buf *out) {
    const char *p = v->start, *end = v->start + v->len;
    while (p < end) {
        if (*p != '\\') {
            const char *q = p;
            while (q < end && *q != '\\') q++;
            put(out, p, (size_t)(q - p));
            p = q;
            continue;
        }
        char e = p[1];
        p += 2;
        switch (e) {
            case 'b': put(out, "\b", 1); break;
            case 'f': put(out, "\f", 1); break;
            case 'n': put(out, "\n", 1); break;
            case 'r': put(out, "\r", 1); break;
            case 't': put(out, "\t", 1); break;
            case 'u': {
                unsigned long cp = hex4(p);
                p += 4;
                if (cp >= 0xD800 && cp < 0xDC00 && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
                    unsigned long lo = hex4(p + 2);
                    if (lo >= 0xDC00 && lo < 0xE000) {
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                        p += 6;
                    }
                }
                put_utf8(out, (cp >= 0xD800 && cp < 0xE000) ? 0xFFFD : cp);
                break;
            }
            default: put(out, &e, 1); break; /* \" \\ \/ */
        }
    }
}

struct reply {
    struct value exit_code, out;
    int has_exit, has_out;
};

static void reply_member(const struct value *key, const struct value *val, void *ctx) {
    struct reply *r = ctx;
    if (key_is(key, "exit")) r->exit_code = *val, r->has_exit = 1;
    if (key_is(key, "stdout")) r->out = *val, r->has_out = 1;
}

/* The agent took the request and then failed: what cni/entry.py prints for thick.AgentLost. */
static void agent_lost(const char *path, const char *why, const struct conf *c) {
    const char *version = LATEST;
    if (c->has_version && c->version.kind == 's' && !c->version.escaped) {
        for (size_t k = 0; k < sizeof SUPPORTED / sizeof *SUPPORTED; k++)
            if (c->version.len == strlen(SUPPORTED[k]) && memcmp(c->version.start, SUPPORTED[k], c->version.len) == 0)
                version = SUPPORTED[k];
    }
    struct buf details = {0};
    puts_(&details, "the agent at ");
    puts_(&details, path);
    puts_(&details, " ");
    puts_(&details, why);
    puts_(&details, "; retry the operation");
    struct buf out = {0};
    puts_(&out, "{\"cniVersion\": \"");
    puts_(&out, version);
    puts_(&out, "\", \"code\": 11, \"msg\": \"try again later\", \"details\": ");
    put_json_string(&out, details.data ? details.data : "", details.len);
    puts_(&out, "}");
    if (out.data) fputs(out.data, stdout);
    fflush(stdout);
    exit(1);
}

static int ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return 0;
    return 1;
}

/* Forward to the agent; returns only when the agent is not there (the caller then runs the Python entry point). */
static void forward(char **envp, const char *in, size_t n, const struct conf *c) {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const struct value *sock = c->has_socket ? &c->socket : c->has_ipam_socket ? &c->ipam_socket : NULL;
    if (sock != NULL) {
        if (sock->kind != 's' || sock->escaped || sock->len == 0 || sock->start[0] != '/' || sock->len >= sizeof path)
            return;
        memcpy(path, sock->start, sock->len);
        path[sock->len] = '\0';
    } else {
        snprintf(path, sizeof path, "%s", DEFAULT_SOCKET);
    }
    double timeout = DEFAULT_AGENT_TIMEOUT;
    if (c->has_timeout) {
        if (c->timeout.kind != 'n') return;
        char num[64];
        if (c->timeout.len >= sizeof num) return;
        memcpy(num, c->timeout.start, c->timeout.len);
        num[c->timeout.len] = '\0';
        timeout = strtod(num, NULL);
        if (!(timeout > 0 && timeout <= 60)) return;
    }

    struct buf frame = {0};
    put(&frame, "\0\0\0\0", 4); /* length, filled in below */
    puts_(&frame, "{\"env\":{");
    int first = 1;
    for (char **e = envp; *e != NULL; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "CNI_", 4) != 0 || eq == NULL) continue;
        if (!ascii(*e, strlen(*e))) return;
        if (!first) put(&frame, ",", 1);
        first = 0;
        put_json_string(&frame, *e, (size_t)(eq - *e));
        put(&frame, ":", 1);
        put_json_string(&frame, eq + 1, strlen(eq + 1));
    }
    puts_(&frame, "},\"stdin\":");
    put_json_string(&frame, in, n);
    puts_(&frame, "}");
    if (frame.oom || frame.len - 4 > MAX_FRAME) return;
    size_t body = frame.len - 4;
    frame.data[0] = (char)(body >> 24), frame.data[1] = (char)(body >> 16);
    frame.data[2] = (char)(body >> 8), frame.data[3] = (char)body;

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, path, strlen(path) + 1);
    set_timeout(fd, timeout);
    char ack = 0, go = GO;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || !send_all(fd, frame.data, frame.len) ||
        !recv_all(fd, &ack, 1) || ack != ACK || !send_all(fd, &go, 1)) {
        close(fd); /* absent, refused, slow or confused: the agent is not serving; Python does the work */
        free(frame.data);
        return;
    }
    free(frame.data);

    /* GO is sent: from here on the agent owns the request. */
    set_timeout(fd, REPLY_TIMEOUT);
    unsigned char len[4];
    if (!recv_all(fd, (char *)len, 4)) {
        agent_lost(path, errno == EAGAIN || errno == EWOULDBLOCK ? "did not answer within 300s"
                                                                  : "failed before answering: connection closed",
                   c);
    }
    size_t size = ((size_t)len[0] << 24) | ((size_t)len[1] << 16) | ((size_t)len[2] << 8) | len[3];
    if (size > MAX_FRAME) agent_lost(path, "failed before answering: its answer is too large", c);
    char *reply_text = malloc(size + 1);
    if (reply_text == NULL || !recv_all(fd, reply_text, size))
        agent_lost(path, "failed before answering: connection closed", c);
    close(fd);

    struct reply r = {0};
    struct scan s = {reply_text, reply_text + size, 0};
    struct value top;
    ws(&s);
    if (s.p >= s.end || *s.p != '{' || !scan_object(&s, &top, reply_member, &r) || !r.has_exit || !r.has_out ||
        r.exit_code.kind != 'n' || r.out.kind != 's') {
        agent_lost(path, "sent a malformed answer", c);
    }
    char code_text[32];
    if (r.exit_code.len >= sizeof code_text) agent_lost(path, "sent a malformed answer", c);
    memcpy(code_text, r.exit_code.start, r.exit_code.len);
    code_text[r.exit_code.len] = '\0';
    char *endp;
    long code = strtol(code_text, &endp, 10);
    if (*endp != '\0') agent_lost(path, "sent a malformed answer", c);
    struct buf out = {0};
    unescape(&r.out, &out);
    if (out.oom) agent_lost(path, "sent an answer too large to hold", c);
    if (out.len) fwrite(out.data, 1, out.len, stdout);
    fflush(stdout);
    exit((int)code);
}

/* ------------------------------------------------------------------ entry */

void nodeplug_fastpath(char **envp, struct stdin_copy *in) {
    const char *command = getenv("CNI_COMMAND");
    const char *standalone = getenv("NODEPLUG_CNI_STANDALONE");
    if (command == NULL || command[0] == '\0') return;
    int is_version = strcmp(command, "VERSION") == 0;
    if (!is_version && standalone != NULL && standalone[0] != '\0' && strcmp(standalone, "0") != 0) return;

    /* Read stdin whole; the caller replays it to Python if we step aside. */
    struct buf b = {0};
    char chunk[65536];
    for (;;) {
        ssize_t r = read(0, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            in->read_failed = errno;
            break;
        }
        if (r == 0) break;
        put(&b, chunk, (size_t)r);
        if (b.oom) break;
    }
    in->data = b.data;
    in->len = b.len;
    in->taken = 1;
    if (b.oom || in->read_failed) return;

    /* Non-ASCII text needs decoding as Python decodes it: leave it to Python. */
    if (b.len > 0 && !ascii(b.data, b.len)) return;
    if (is_version) answer_version(b.data ? b.data : "", b.len);
    if (b.len == 0) return;
    struct conf c;
    if (!scan_config(b.data, b.len, &c)) return;
    forward(envp, b.data, b.len, &c);
}
