package ucx

/*
#include <stdint.h>
#include <ucp/api/ucp.h>

static ucs_status_t troupe_memory_types(ucp_context_h c, uint64_t *types) {
	ucp_context_attr_t a;
	a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	ucs_status_t st = ucp_context_query(c, &a);
	if (st == UCS_OK) {
		*types = a.memory_types;
	}
	return st;
}

static void *troupe_addr_ptr(uintptr_t a) { return (void *)a; }
*/
import "C"

import "unsafe"

// MemoryType is a UCX memory type (ucs_memory_type_t).
type MemoryType int

// Memory types troupe asks about.
const (
	MemoryHost        MemoryType = C.UCS_MEMORY_TYPE_HOST
	MemoryCUDA        MemoryType = C.UCS_MEMORY_TYPE_CUDA
	MemoryCUDAManaged MemoryType = C.UCS_MEMORY_TYPE_CUDA_MANAGED
)

// MemoryTypes is a set of memory types, bit i standing for MemoryType i.
type MemoryTypes uint64

// Has reports whether t is in the set.
func (s MemoryTypes) Has(t MemoryType) bool { return s&(1<<uint(t)) != 0 }

// MemoryTypes returns the memory types the context's transports can access
// directly (ucp_context_query, UCP_ATTR_FIELD_MEMORY_TYPES).
func (c *Context) MemoryTypes() (MemoryTypes, error) {
	var v C.uint64_t
	if err := check("ucp_context_query", C.troupe_memory_types(c.h, &v)); err != nil {
		return 0, err
	}
	return MemoryTypes(v), nil
}

// AddrPointer turns a raw address of memory outside the Go heap (device
// memory, for example) into a pointer for Buffer.Ptr. The memory must stay
// allocated until the operation using it completes.
func AddrPointer(addr uintptr) unsafe.Pointer { return C.troupe_addr_ptr(C.uintptr_t(addr)) }
