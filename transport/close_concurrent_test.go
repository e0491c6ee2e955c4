package transport

import (
	"context"
	"errors"
	"sync"
	"testing"
)

// A Close called while another runs returns once the transport is closed,
// not at once: it returned nil while the first still tore the worker
// down, and a caller that then freed its buffers did so under UCX.
func TestConcurrentCloseWaits(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) {
			for range 5 {
				ts := localJob(t, 2, mode)
				// Pending receives give the first Close endpoints to close.
				for tag := range 8 {
					if _, err := ts[0].Irecv(1, tag, make([]byte, 64)); err != nil {
						t.Fatal(err)
					}
				}
				var wg sync.WaitGroup
				wg.Add(1)
				go func() {
					defer wg.Done()
					_ = ts[0].Close()
				}()
				for {
					ts[0].mu.Lock()
					closed := ts[0].closed
					ts[0].mu.Unlock()
					if closed {
						break
					}
				}
				if err := ts[0].Close(); err != nil {
					t.Fatal(err)
				}
				ts[0].mu.Lock()
				gone := ts[0].loopGone
				ts[0].mu.Unlock()
				if !gone {
					t.Fatal("the second Close returned while the first was still closing the transport")
				}
				wg.Wait()
			}
		})
	}
}

// shapeOnly is a Bootstrapper that only says the job's shape: New must
// refuse a shape it cannot address before it exchanges anything.
type shapeOnly struct{ rank, size int }

func (b shapeOnly) Rank() int { return b.rank }
func (b shapeOnly) Size() int { return b.size }
func (b shapeOnly) AllGather(context.Context, string, []byte) ([][]byte, error) {
	return nil, errors.New("shapeOnly: no exchange")
}
func (b shapeOnly) Barrier(context.Context, string) error {
	return errors.New("shapeOnly: no exchange")
}
func (b shapeOnly) Close() error { return nil }

// A job wider than the wire tags' 24-bit source field (ranks 2^24 apart
// would take each other's messages), or a rank outside its job, is
// refused by New with ErrInvalid.
func TestNewRefusesUnaddressableJob(t *testing.T) {
	for _, b := range []shapeOnly{{0, MaxUserRanks + 1}, {0, 0}, {3, 3}, {-1, 2}} {
		if _, err := New(context.Background(), Options{Bootstrap: b}); !errors.Is(err, ErrInvalid) {
			t.Errorf("New with rank %d of %d: %v, want ErrInvalid", b.rank, b.size, err)
		}
	}
}
