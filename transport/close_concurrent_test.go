package transport

import (
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
