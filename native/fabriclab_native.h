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
#include "core.h"
#include "course.h"
#include "service.h"
#include "sharing.h"
#endif
