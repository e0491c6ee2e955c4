package transport

import (
	"context"
	"errors"
	"fmt"

	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// StartLocal starts a job of n ranks inside this process (DESIGN 2, third
// way): a loopback rendezvous service and n transports, each with its own
// UCX context and worker, really talking through UCX. opts.Bootstrap is
// ignored. The returned stop function closes the transports and the service.
func StartLocal(ctx context.Context, n int, opts Options) ([]*Transport, func(), error) {
	return startLocal(ctx, n, func(int) Options { return opts })
}

// startLocal is StartLocal with each rank's options from opts (so that
// tests can give every rank a RendezvousPolicy of its own, which ranks
// must not share).
func startLocal(ctx context.Context, n int, opts func(rank int) Options) ([]*Transport, func(), error) {
	tok, err := bootstrap.NewToken()
	if err != nil {
		return nil, nil, err
	}
	srv, err := bootstrap.NewServer(n, tok, opts(0).Log)
	if err != nil {
		return nil, nil, err
	}
	ts := make([]*Transport, n)
	boots := make([]bootstrap.Bootstrapper, n)
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func(i int) {
			b, err := bootstrap.Dial(ctx, srv.Addr(), tok, i, n)
			if err != nil {
				errs <- fmt.Errorf("rank %d: %w", i, err)
				return
			}
			boots[i] = b
			o := opts(i)
			o.Bootstrap = b
			ts[i], err = New(ctx, o)
			errs <- err
		}(i)
	}
	var all []error
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			all = append(all, err)
		}
	}
	stop := func() {
		unregisterLocal(ts)
		for i := range ts {
			if ts[i] != nil {
				_ = ts[i].Close()
			}
			if boots[i] != nil {
				_ = boots[i].Close()
			}
		}
		_ = srv.Close()
	}
	if len(all) > 0 {
		stop()
		return nil, nil, errors.Join(all...)
	}
	registerLocal(ts) // same-process channel transfers (channel_paths.go)
	return ts, stop, nil
}
