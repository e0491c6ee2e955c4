package ucx

/*
#include <ucp/api/ucp.h>

static ucs_status_t troupe_max_am_header(ucp_worker_h w, size_t *n) {
	ucp_worker_attr_t a;
	a.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
	ucs_status_t st = ucp_worker_query(w, &a);
	if (st == UCS_OK) {
		*n = a.max_am_header;
	}
	return st;
}
*/
import "C"

// MaxAMHeader returns the longest user header an active message of this
// worker may carry (ucp_worker_query, UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER).
// UCX 1.13 aborts the process on a longer one rather than failing the send.
func (w *Worker) MaxAMHeader() (int, error) {
	var n C.size_t
	if err := check("ucp_worker_query", C.troupe_max_am_header(w.h, &n)); err != nil {
		return 0, err
	}
	return int(n), nil
}
