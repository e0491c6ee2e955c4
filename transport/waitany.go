package transport

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
)

// WaitAny blocks until one of reqs completes (MPI_Waitany) and returns its
// index and result; of several complete ones, the lowest index. Nil
// entries are skipped, as MPI skips null requests: set reqs[i] to nil after
// handling it to wait for the others next. With no request left it returns
// -1 at once.
//
// Like Wait, it first progresses the worker itself for up to WaitSpin (in
// direct mode), then parks. If ctx ends first, WaitAny returns -1 and ctx's
// error and cancels nothing: the requests stay in flight (Wait one with an
// ended context to cancel it).
func WaitAny(ctx context.Context, reqs []*Request) (int, Status, error) {
	first := func() int {
		for i, r := range reqs {
			if r != nil && r.fin.Load() {
				return i
			}
		}
		return -1
	}
	var ts []*Transport
	for _, r := range reqs {
		if r != nil && !slices.Contains(ts, r.t) {
			ts = append(ts, r.t)
		}
	}
	if len(ts) == 0 {
		return -1, Status{}, nil
	}
	done := func() bool { return first() >= 0 }
	if !done() && !ts[0].spinWait(done) {
		// Park until a request's Done channel or ctx's closes; every
		// transport involved keeps progressing meanwhile.
		for _, t := range ts {
			t.park()
		}
		cases := make([]reflect.SelectCase, 0, len(reqs)+1)
		cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ctx.Done())})
		for _, r := range reqs {
			if r != nil {
				cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(r.Done())})
			}
		}
		chosen, _, _ := reflect.Select(cases)
		for _, t := range ts {
			t.parked.Add(-1)
		}
		if chosen == 0 && !done() {
			return -1, Status{}, ctx.Err()
		}
	}
	i := first()
	return i, reqs[i].status, reqs[i].err
}

// WaitAll waits for every request in reqs (MPI_Waitall; nil entries are
// skipped) and returns their statuses in order. Its error joins the
// failed requests' errors, each naming its index; as with Wait, a receive
// still in flight when ctx ends is cancelled.
func WaitAll(ctx context.Context, reqs []*Request) ([]Status, error) {
	sts := make([]Status, len(reqs))
	var errs []error
	for i, r := range reqs {
		if r == nil {
			continue
		}
		st, err := r.Wait(ctx)
		sts[i] = st
		if err != nil {
			errs = append(errs, fmt.Errorf("request %d: %w", i, err))
		}
	}
	return sts, errors.Join(errs...)
}
