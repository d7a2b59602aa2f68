/* Headers the cffi module compiles against: libfabric's, plus fabriclab's own native code. */
#ifndef FABRICLAB_NATIVE_H
#define FABRICLAB_NATIVE_H
#include <string.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
/* The endpoint option that tells whether a provider's GPU memory support needs the CUDA API (bounce
 * buffers) rather than GPUDirect RDMA; libfabric 1.18 added it. */
#if FI_MAJOR_VERSION > 1 || FI_MINOR_VERSION >= 18
#define FL_OPT_CUDA_API_PERMITTED FI_OPT_CUDA_API_PERMITTED
#else
#define FL_OPT_CUDA_API_PERMITTED (-1)
#endif
#include "core.h"
#include "course.h"
#include "service.h"
#include "sharing.h"
#include "copyrate.h"
#endif
