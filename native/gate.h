/* Gates of GPU regions that peers on this host write through CUDA IPC (fabriclab/ipc.py): one 64-byte slot
 * per region in memory the target shares with its writers. A writer passes the gate before each copy and
 * leaves it once the copy is done; the target shuts it when the region closes and then waits until no writer
 * is inside. Sequentially consistent, so that a writer entering while the target shuts either sees the gate
 * shut or is seen inside (never both missed). */
#ifndef FABRICLAB_GATE_H
#define FABRICLAB_GATE_H
#include <stdint.h>

#define FL_GATE_BYTES 64
enum fl_gate_status { FL_GATE_PASSED = 0, FL_GATE_SHUT = 1 };

void fl_gate_open(void *slot, uint64_t key);
int fl_gate_enter(void *slot, uint64_t key);
void fl_gate_leave(void *slot);
uint32_t fl_gate_shut(void *slot);
uint32_t fl_gate_inside(void *slot);
#endif
