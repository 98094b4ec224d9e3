/* nodeplug CNI fast path (fastpath.c): VERSION and thick-mode forwarding without starting Python. */
#ifndef NODEPLUG_FASTPATH_H
#define NODEPLUG_FASTPATH_H

#include <stddef.h>

/* What the fast path read from stdin before stepping aside: the caller hands it to the Python entry point. */
struct stdin_copy {
    char *data;
    size_t len;
    int taken;       /* stdin was read (data/len hold all of it, unless read_failed) */
    int read_failed; /* errno of a failed read, else 0 */
};

/* Answers and exits when it can; returns when the Python entry point must run (see fastpath.c). */
void nodeplug_fastpath(char **envp, struct stdin_copy *in);

#endif
