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
	ts := transportsOf(reqs)
	if len(ts) == 0 {
		return -1, Status{}, nil
	}
	done := func() bool { return first() >= 0 }
	if !done() {
		if err := ts[0].waitInHandler("wait any", -1, 0); err != nil {
			return -1, Status{}, err
		}
	}
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

// WaitSome blocks until at least one of reqs has completed (MPI_Waitsome)
// and returns the indices of every completed one, in order, with their
// statuses; nil entries are skipped, so set the handled ones to nil before
// calling it again. Its error joins the errors of the completed requests
// that failed, each naming its index. With no request left it returns nil
// at once. If ctx ends first, it returns ctx's error and cancels nothing,
// as WaitAny does.
func WaitSome(ctx context.Context, reqs []*Request) ([]int, []Status, error) {
	if i, _, err := WaitAny(ctx, reqs); i < 0 {
		return nil, nil, err
	}
	return completed(reqs)
}

// TestAny reports, without blocking, one completed request of reqs
// (MPI_Testany): the lowest index of a completed one and its result, or -1
// when none has completed or every entry is nil. Like Test, it first makes
// one progress pass of each transport involved in direct mode.
func TestAny(reqs []*Request) (int, Status, error) {
	testPasses(reqs)
	for i, r := range reqs {
		if r != nil && r.fin.Load() {
			return i, r.status, r.err
		}
	}
	return -1, Status{}, nil
}

// TestAll reports, without blocking, whether every request in reqs has
// completed (MPI_Testall; nil entries are skipped). Only then does it
// return their statuses in order, with an error joining the failed ones'
// errors, each naming its index. Like Test, it first makes one progress
// pass of each transport involved in direct mode.
func TestAll(reqs []*Request) (bool, []Status, error) {
	testPasses(reqs)
	for _, r := range reqs {
		if r != nil && !r.fin.Load() {
			return false, nil, nil
		}
	}
	idx, done, err := completed(reqs)
	sts := make([]Status, len(reqs))
	for k, i := range idx {
		sts[i] = done[k]
	}
	return true, sts, err
}

// completed returns the indices and statuses of the completed requests of
// reqs, with an error joining the failed ones' errors.
func completed(reqs []*Request) ([]int, []Status, error) {
	var (
		idx  []int
		sts  []Status
		errs []error
	)
	for i, r := range reqs {
		if r == nil || !r.fin.Load() {
			continue
		}
		idx = append(idx, i)
		sts = append(sts, r.status)
		if r.err != nil {
			errs = append(errs, fmt.Errorf("request %d: %w", i, r.err))
		}
	}
	return idx, sts, errors.Join(errs...)
}

// testPasses makes Test's progress pass once for each transport of reqs,
// unless every request has completed already.
func testPasses(reqs []*Request) {
	for _, r := range reqs {
		if r != nil && !r.fin.Load() {
			for _, t := range transportsOf(reqs) {
				t.testPass()
			}
			return
		}
	}
}

// transportsOf lists the transports of the requests in reqs, each once.
func transportsOf(reqs []*Request) []*Transport {
	var ts []*Transport
	for _, r := range reqs {
		if r != nil && !slices.Contains(ts, r.t) {
			ts = append(ts, r.t)
		}
	}
	return ts
}
