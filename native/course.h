/* The course's run loops (chapters 9-15) over the engine core: a timed write run and its target. */
#ifndef FABRICLAB_COURSE_H
#define FABRICLAB_COURSE_H
#include "core.h"

/* Writer: runs the configured transfer to completion (or error/stop); 0 or a negative error code. */
int fl_write_run(fl_engine *e, const fl_config *cfg);
/* Target: one thread (pinned to `core`, or not where it is negative) polls every NIC until expected_arrivals
 * writes (marked writes with e->marks_only) have landed, stop is set, or the writer has been silent for
 * timeout_s during a run. `manual_progress`: the provider moves writes only while the target polls
 * (FI_PROGRESS_MANUAL), so an idle target yields its core but never sleeps during a run. See course.c. */
int fl_target_run(fl_engine *e, int core, int manual_progress, double timeout_s);
#endif
