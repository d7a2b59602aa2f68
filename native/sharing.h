/* Lesson 13's measurement (sharing.c): ns per counter update for `threads` threads updating a counter
 * `updates` times each, thread t pinned to cores[t % ncores] (ncores 0: not pinned). Layouts: one shared
 * atomic (chapters 11-12), per-thread slots packed into one cache line (13), a cache line each (13+).
 * The threads start together from a barrier. Returns the mean over threads of each thread's ns per update,
 * or -1 for bad arguments or a thread that could not start; `overlap` (may be NULL) gets the share of the
 * run in which every thread was updating at once, on a CPU (0 to 1): where it is low, the threads took
 * turns (more threads than cores, or a busy machine) and the line did not have to move. */
#ifndef FABRICLAB_SHARING_H
#define FABRICLAB_SHARING_H
#include <stdint.h>

#define FL_SHARED_ATOMIC 0
#define FL_PACKED_SLOTS 1
#define FL_PADDED_SLOTS 2
double fl_counter_bench(int layout, int threads, uint64_t updates, const int *cores, int ncores, double *overlap);
#endif
