/* nodeplug CNI fast path (fastpath.c): hand an invocation to the warm agent without starting Python. */
#ifndef NODEPLUG_FASTPATH_H
#define NODEPLUG_FASTPATH_H

#include <stddef.h>

/* Sends the invocation (the CNI_* variables of envp and the bytes of stdin) to the agent ($NODEPLUG_CNI_SOCKET, else
 * the socket recorded in dir/../NP_SOCKET_RECORD, dir being the launcher's own directory, else the default). Prints
 * the agent's answer and exits with its status when the agent answers; otherwise returns, having noted in the
 * environment what the Python entry point must know (the agent already asked, a connection handed on, an agent lost
 * after GO). */
void nodeplug_fastpath(char **envp, const char *in, size_t n, const char *dir);

#endif
