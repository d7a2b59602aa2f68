/* Snapshots of signal dispositions, to undo handlers a library installs behind the caller's back
 * (native/signals.c says which and why). */
#ifndef FABRICLAB_SIGNALS_H
#define FABRICLAB_SIGNALS_H

typedef struct fl_signal_snapshot fl_signal_snapshot;

/* The current sigaction of each of signals[0..count); NULL (errno set) when out of memory. */
fl_signal_snapshot *fl_signals_snapshot(const int *signals, int count);
/* The signals whose handler or flags changed since the snapshot (up to max of them written to changed);
 * returns how many changed. */
int fl_signals_changed(const fl_signal_snapshot *snap, int *changed, int max);
/* Like fl_signals_changed, and puts each changed one back as it was; -errno if a sigaction() fails. */
int fl_signals_restore(const fl_signal_snapshot *snap, int *restored, int max);
void fl_signals_free(fl_signal_snapshot *snap);

#endif
