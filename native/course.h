/* The course's run loops (chapters 9-15) over the engine core: a timed write run and its target. */
#ifndef FABRICLAB_COURSE_H
#define FABRICLAB_COURSE_H
#include "core.h"

/* Writer: runs the configured transfer to completion (or error/stop); 0 or a negative error code. */
int fl_write_run(fl_engine *e, const fl_config *cfg);
/* Target: polls every NIC with `threads` threads, counting writes per page, until expected_arrivals
 * have landed, stop is set, or nothing arrives for timeout_s while some are still expected. */
int fl_target_run(fl_engine *e, int threads, const int *cores, int pin, double timeout_s);
#endif
