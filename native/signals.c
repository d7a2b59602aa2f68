/* Signal dispositions around libfabric calls that may install handlers of their own.
 *
 * libfabric 1.17's shm provider, at the first fi_endpoint of a process (measured with these functions;
 * other providers and versions may do it when they initialise, in fi_getinfo or fi_fabric), installs
 * handlers for SIGINT, SIGTERM, SIGSEGV and SIGBUS that shm_unlink the process's /dev/shm regions and
 * then chain to the previous handler. Under Python that previous handler turns SIGINT into
 * KeyboardInterrupt, so the process lives on without its region, and the next peer it writes to maps a
 * region that no longer exists and crashes. fabriclab.fi snapshots the dispositions before each such call
 * and puts back every one that changed (fi._keeping_signal_handlers).
 *
 * Only sigaction() is used, never signal(): it keeps SA_SIGINFO handlers, flags and masks intact. */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>

#include "signals.h"

struct fl_signal_snapshot {
    int count;
    struct {
        int signum;
        int valid; /* sigaction() could read it (the C library reserves a few real-time signals) */
        struct sigaction action;
    } entries[];
};

fl_signal_snapshot *fl_signals_snapshot(const int *signals, int count)
{
    if (count < 0) {
        errno = EINVAL;
        return NULL;
    }
    fl_signal_snapshot *snap = calloc(1, sizeof(*snap) + (size_t)count * sizeof(snap->entries[0]));
    if (snap == NULL)
        return NULL;
    snap->count = count;
    for (int i = 0; i < count; i++) {
        snap->entries[i].signum = signals[i];
        snap->entries[i].valid = sigaction(signals[i], NULL, &snap->entries[i].action) == 0;
    }
    return snap;
}

/* The flags an application chooses. The C library adds its own when a handler is set (SA_RESTORER on
 * Linux), so a disposition put back reads differently from one never touched: those are not compared. */
#define CHOSEN_FLAGS (SA_SIGINFO | SA_RESTART | SA_ONSTACK | SA_NODEFER | SA_RESETHAND | SA_NOCLDSTOP | SA_NOCLDWAIT)

static const void *handler_of(const struct sigaction *a)
{
    /* sa_handler and sa_sigaction share storage; SA_SIGINFO says which one is meant */
    return (a->sa_flags & SA_SIGINFO) ? (const void *)a->sa_sigaction : (const void *)a->sa_handler;
}

/* Writes the numbers of the signals whose handler or chosen flags differ from the snapshot to `changed` (up to
 * `max`, which may be 0) and returns how many there are; with `restore`, also puts each one back. */
static int compare(const fl_signal_snapshot *snap, int *changed, int max, int restore)
{
    int n = 0;
    for (int i = 0; i < snap->count; i++) {
        struct sigaction now;
        if (!snap->entries[i].valid || sigaction(snap->entries[i].signum, NULL, &now) != 0)
            continue;
        const struct sigaction *then = &snap->entries[i].action;
        if (handler_of(&now) == handler_of(then)
            && (now.sa_flags & CHOSEN_FLAGS) == (then->sa_flags & CHOSEN_FLAGS))
            continue;
        if (restore && sigaction(snap->entries[i].signum, then, NULL) != 0)
            return -errno;
        if (n < max)
            changed[n] = snap->entries[i].signum;
        n++;
    }
    return n;
}

int fl_signals_changed(const fl_signal_snapshot *snap, int *changed, int max)
{
    return compare(snap, changed, max, 0);
}

int fl_signals_restore(const fl_signal_snapshot *snap, int *restored, int max)
{
    return compare(snap, restored, max, 1);
}

void fl_signals_free(fl_signal_snapshot *snap)
{
    free(snap);
}
