/* What the model does not offer still answers: every entry point libfabric's inline calls jump through is
 * set, and says -FI_ENOSYS (fi_getinfo reports none of these capabilities: tagged messages, atomics,
 * collectives, fi_read, connections, scalable endpoints, shared contexts, wait and poll sets). */
#include "sim.h"

/* One function per signature: called through the pointer of its own type, never a cast. */
#define SIM_NOSYS(ret, name, ...) \
    ret name(__VA_ARGS__) { return -FI_ENOSYS; }
#define SIM_NOSYS_STATIC(ret, name, ...) \
    static ret name(__VA_ARGS__) { return -FI_ENOSYS; }

/* --------------------------------------------------------------------------------- any object */

SIM_NOSYS(int, sim_no_bind, struct fid *fid, struct fid *bfid, uint64_t flags)
SIM_NOSYS(int, sim_no_control, struct fid *fid, int command, void *arg)
SIM_NOSYS(int, sim_no_ops_open, struct fid *fid, const char *name, uint64_t flags, void **ops, void *context)
SIM_NOSYS(int, sim_no_ops_set, struct fid *fid, const char *name, uint64_t flags, void *ops, void *context)

/* -------------------------------------------------------------------------- fabric and domain */

SIM_NOSYS(int, sim_no_passive_ep, struct fid_fabric *fabric, struct fi_info *info, struct fid_pep **pep,
          void *context)
SIM_NOSYS(int, sim_no_wait_open, struct fid_fabric *fabric, struct fi_wait_attr *attr, struct fid_wait **waitset)
SIM_NOSYS(int, sim_no_scalable_ep, struct fid_domain *domain, struct fi_info *info, struct fid_ep **sep,
          void *context)
SIM_NOSYS(int, sim_no_poll_open, struct fid_domain *domain, struct fi_poll_attr *attr, struct fid_poll **pollset)
SIM_NOSYS(int, sim_no_stx_ctx, struct fid_domain *domain, struct fi_tx_attr *attr, struct fid_stx **stx,
          void *context)
SIM_NOSYS(int, sim_no_srx_ctx, struct fid_domain *domain, struct fi_rx_attr *attr, struct fid_ep **rx_ep,
          void *context)
SIM_NOSYS(int, sim_no_query_atomic, struct fid_domain *domain, enum fi_datatype datatype, enum fi_op op,
          struct fi_atomic_attr *attr, uint64_t flags)
SIM_NOSYS(int, sim_no_query_collective, struct fid_domain *domain, enum fi_collective_op coll,
          struct fi_collective_attr *attr, uint64_t flags)
SIM_NOSYS(int, sim_no_av_set, struct fid_av *av, struct fi_av_set_attr *attr, struct fid_av_set **set,
          void *context)

/* ------------------------------------------------------- endpoint: connections, contexts, reads */

SIM_NOSYS(int, sim_no_setname, fid_t fid, void *addr, size_t addrlen)
SIM_NOSYS(int, sim_no_getpeer, struct fid_ep *ep, void *addr, size_t *addrlen)
SIM_NOSYS(int, sim_no_connect, struct fid_ep *ep, const void *addr, const void *param, size_t paramlen)
SIM_NOSYS(int, sim_no_listen, struct fid_pep *pep)
SIM_NOSYS(int, sim_no_accept, struct fid_ep *ep, const void *param, size_t paramlen)
SIM_NOSYS(int, sim_no_reject, struct fid_pep *pep, fid_t handle, const void *param, size_t paramlen)
SIM_NOSYS(int, sim_no_shutdown, struct fid_ep *ep, uint64_t flags)
SIM_NOSYS(int, sim_no_join, struct fid_ep *ep, const void *addr, uint64_t flags, struct fid_mc **mc, void *context)
SIM_NOSYS(int, sim_no_tx_ctx, struct fid_ep *sep, int index, struct fi_tx_attr *attr, struct fid_ep **tx_ep,
          void *context)
SIM_NOSYS(int, sim_no_rx_ctx, struct fid_ep *sep, int index, struct fi_rx_attr *attr, struct fid_ep **rx_ep,
          void *context)
SIM_NOSYS(ssize_t, sim_no_read, struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr,
          uint64_t key, void *context)
SIM_NOSYS(ssize_t, sim_no_readv, struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
          fi_addr_t src, uint64_t addr, uint64_t key, void *context)
SIM_NOSYS(ssize_t, sim_no_readmsg, struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)

/* -------------------------------------------------------------------------------- tagged messages */

SIM_NOSYS_STATIC(ssize_t, t_recv, struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src,
                 uint64_t tag, uint64_t ignore, void *context)
SIM_NOSYS_STATIC(ssize_t, t_recvv, struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
                 fi_addr_t src, uint64_t tag, uint64_t ignore, void *context)
SIM_NOSYS_STATIC(ssize_t, t_recvmsg, struct fid_ep *ep, const struct fi_msg_tagged *msg, uint64_t flags)
SIM_NOSYS_STATIC(ssize_t, t_send, struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest,
                 uint64_t tag, void *context)
SIM_NOSYS_STATIC(ssize_t, t_sendv, struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count,
                 fi_addr_t dest, uint64_t tag, void *context)
SIM_NOSYS_STATIC(ssize_t, t_sendmsg, struct fid_ep *ep, const struct fi_msg_tagged *msg, uint64_t flags)
SIM_NOSYS_STATIC(ssize_t, t_inject, struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest, uint64_t tag)
SIM_NOSYS_STATIC(ssize_t, t_senddata, struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                 fi_addr_t dest, uint64_t tag, void *context)
SIM_NOSYS_STATIC(ssize_t, t_injectdata, struct fid_ep *ep, const void *buf, size_t len, uint64_t data,
                 fi_addr_t dest, uint64_t tag)

struct fi_ops_tagged sim_no_tagged_ops = {.size = sizeof(struct fi_ops_tagged), .recv = t_recv, .recvv = t_recvv,
                                          .recvmsg = t_recvmsg, .send = t_send, .sendv = t_sendv,
                                          .sendmsg = t_sendmsg, .inject = t_inject, .senddata = t_senddata,
                                          .injectdata = t_injectdata};

/* ---------------------------------------------------------------------------------------- atomics */

SIM_NOSYS_STATIC(ssize_t, a_write, struct fid_ep *ep, const void *buf, size_t count, void *desc, fi_addr_t dest,
                 uint64_t addr, uint64_t key, enum fi_datatype datatype, enum fi_op op, void *context)
SIM_NOSYS_STATIC(ssize_t, a_writev, struct fid_ep *ep, const struct fi_ioc *iov, void **desc, size_t count,
                 fi_addr_t dest, uint64_t addr, uint64_t key, enum fi_datatype datatype, enum fi_op op,
                 void *context)
SIM_NOSYS_STATIC(ssize_t, a_writemsg, struct fid_ep *ep, const struct fi_msg_atomic *msg, uint64_t flags)
SIM_NOSYS_STATIC(ssize_t, a_inject, struct fid_ep *ep, const void *buf, size_t count, fi_addr_t dest, uint64_t addr,
                 uint64_t key, enum fi_datatype datatype, enum fi_op op)
SIM_NOSYS_STATIC(ssize_t, a_readwrite, struct fid_ep *ep, const void *buf, size_t count, void *desc, void *result,
                 void *result_desc, fi_addr_t dest, uint64_t addr, uint64_t key, enum fi_datatype datatype,
                 enum fi_op op, void *context)
SIM_NOSYS_STATIC(ssize_t, a_readwritev, struct fid_ep *ep, const struct fi_ioc *iov, void **desc, size_t count,
                 struct fi_ioc *resultv, void **result_desc, size_t result_count, fi_addr_t dest, uint64_t addr,
                 uint64_t key, enum fi_datatype datatype, enum fi_op op, void *context)
SIM_NOSYS_STATIC(ssize_t, a_readwritemsg, struct fid_ep *ep, const struct fi_msg_atomic *msg,
                 struct fi_ioc *resultv, void **result_desc, size_t result_count, uint64_t flags)
SIM_NOSYS_STATIC(ssize_t, a_compwrite, struct fid_ep *ep, const void *buf, size_t count, void *desc,
                 const void *compare, void *compare_desc, void *result, void *result_desc, fi_addr_t dest,
                 uint64_t addr, uint64_t key, enum fi_datatype datatype, enum fi_op op, void *context)
SIM_NOSYS_STATIC(ssize_t, a_compwritev, struct fid_ep *ep, const struct fi_ioc *iov, void **desc, size_t count,
                 const struct fi_ioc *comparev, void **compare_desc, size_t compare_count, struct fi_ioc *resultv,
                 void **result_desc, size_t result_count, fi_addr_t dest, uint64_t addr, uint64_t key,
                 enum fi_datatype datatype, enum fi_op op, void *context)
SIM_NOSYS_STATIC(ssize_t, a_compwritemsg, struct fid_ep *ep, const struct fi_msg_atomic *msg,
                 const struct fi_ioc *comparev, void **compare_desc, size_t compare_count, struct fi_ioc *resultv,
                 void **result_desc, size_t result_count, uint64_t flags)
SIM_NOSYS_STATIC(int, a_valid, struct fid_ep *ep, enum fi_datatype datatype, enum fi_op op, size_t *count)

struct fi_ops_atomic sim_no_atomic_ops = {
    .size = sizeof(struct fi_ops_atomic), .write = a_write, .writev = a_writev, .writemsg = a_writemsg,
    .inject = a_inject, .readwrite = a_readwrite, .readwritev = a_readwritev, .readwritemsg = a_readwritemsg,
    .compwrite = a_compwrite, .compwritev = a_compwritev, .compwritemsg = a_compwritemsg, .writevalid = a_valid,
    .readwritevalid = a_valid, .compwritevalid = a_valid};

/* ------------------------------------------------------------------------------------ collectives */

SIM_NOSYS_STATIC(ssize_t, c_barrier, struct fid_ep *ep, fi_addr_t coll_addr, void *context)
SIM_NOSYS_STATIC(ssize_t, c_barrier2, struct fid_ep *ep, fi_addr_t coll_addr, uint64_t flags, void *context)
SIM_NOSYS_STATIC(ssize_t, c_broadcast, struct fid_ep *ep, void *buf, size_t count, void *desc, fi_addr_t coll_addr,
                 fi_addr_t root_addr, enum fi_datatype datatype, uint64_t flags, void *context)
/* alltoall, allgather: one signature */
SIM_NOSYS_STATIC(ssize_t, c_gatherall, struct fid_ep *ep, const void *buf, size_t count, void *desc, void *result,
                 void *result_desc, fi_addr_t coll_addr, enum fi_datatype datatype, uint64_t flags, void *context)
/* allreduce, reduce_scatter: one signature */
SIM_NOSYS_STATIC(ssize_t, c_reduceall, struct fid_ep *ep, const void *buf, size_t count, void *desc, void *result,
                 void *result_desc, fi_addr_t coll_addr, enum fi_datatype datatype, enum fi_op op, uint64_t flags,
                 void *context)
SIM_NOSYS_STATIC(ssize_t, c_reduce, struct fid_ep *ep, const void *buf, size_t count, void *desc, void *result,
                 void *result_desc, fi_addr_t coll_addr, fi_addr_t root_addr, enum fi_datatype datatype,
                 enum fi_op op, uint64_t flags, void *context)
/* scatter, gather: one signature */
SIM_NOSYS_STATIC(ssize_t, c_rooted, struct fid_ep *ep, const void *buf, size_t count, void *desc, void *result,
                 void *result_desc, fi_addr_t coll_addr, fi_addr_t root_addr, enum fi_datatype datatype,
                 uint64_t flags, void *context)
SIM_NOSYS_STATIC(ssize_t, c_msg, struct fid_ep *ep, const struct fi_msg_collective *msg, struct fi_ioc *resultv,
                 void **result_desc, size_t result_count, uint64_t flags)

struct fi_ops_collective sim_no_collective_ops = {
    .size = sizeof(struct fi_ops_collective), .barrier = c_barrier, .broadcast = c_broadcast,
    .alltoall = c_gatherall, .allreduce = c_reduceall, .allgather = c_gatherall, .reduce_scatter = c_reduceall,
    .reduce = c_reduce, .scatter = c_rooted, .gather = c_rooted, .msg = c_msg, .barrier2 = c_barrier2};
