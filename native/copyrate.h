/* The bench's memcpy ceiling (copyrate.c): what the CPU copies per second when `threads` threads each copy
 * their own `bytes_per_thread` slice at once. That is the work two processes on one host do over shm: one
 * CPU copy per byte (source into the target, through process_vm_writev or a bounce buffer), spread over
 * the engines' threads on disjoint buffers. */
#ifndef FABRICLAB_COPYRATE_H
#define FABRICLAB_COPYRATE_H
#include <stddef.h>

/* Thread t is pinned to cores[t % ncores] (ncores 0: not pinned), allocates its own source and target
 * (so they sit on its NUMA node) and touches every page of both before any timing. Then `repeats` times:
 * all threads wait at a barrier, each copies its slice once; the repeat lasts from the first thread's
 * start to the last one's end. gbps[r] receives repeat r's aggregate rate (all threads' bytes over that
 * span, in Gbps). Returns 0, or -1 for bad arguments (at most 1024 threads) or when memory or a thread
 * could not be had. */
int fl_memcpy_rate(int threads, size_t bytes_per_thread, int repeats, const int *cores, int ncores, double *gbps);
#endif
