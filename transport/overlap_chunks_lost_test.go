package transport

import (
	"runtime"
	"testing"
	"unsafe"

	"github.com/troupe-hpc/troupe/overlap"
)

// chunkCounts returns how many channel messages tr's engine counts chunks
// of (taken in part, the last chunk not yet).
func chunkCounts(tr *Transport) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return len(tr.ov.chunks)
}

// prefetchDone reports whether tr's engine holds a prefetched message
// whose data is in place.
func prefetchDone(tr *Transport) bool {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, m := range tr.ov.unexp {
		if m.mode == overlap.Prefetch && m.done {
			return true
		}
	}
	return false
}

// TestOverlapPeerLostDropsChunkCounts: with the engine on, the chunk count
// of a channel message of which the engine took some chunks, not the last,
// goes when the sending rank is lost: the rest will not come. Before, only
// the counts of channels still open on the rank went (the sender was
// found through the open channel, a channel tag does not name it), and a
// count whose channel was closed first stayed for good. Rank 1 sends the
// first full chunk of a message on channel 61 and is then reported lost to
// rank 0: with the channel open throughout, closed after the chunk was
// taken, and opened only after the chunk was taken (another channel open,
// so that the engine takes it) and closed again.
func TestOverlapPeerLostDropsChunkCounts(t *testing.T) {
	t.Setenv("TROUPE_CMA", "off")
	const id = 61
	for _, tc := range []struct {
		name                   string
		openBefore, closeFirst bool
	}{
		{"open", true, false},
		{"closed", true, true},
		{"opened-after-closed", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLocalPath = true
			t.Cleanup(func() { noLocalPath = false })
			// The chunk is prefetched, which lets its send complete.
			ts := localJobWith(t, 2, Options{Overlap: &recordingPolicy{}})
			ctx := testCtx(t)
			var ch *Channel
			if tc.openBefore {
				c, err := ts[0].Channel(id, 1)
				if err != nil {
					t.Fatal(err)
				}
				ch = c
			} else {
				// Another channel open: the engine takes channel messages.
				other, err := ts[0].Channel(id+1, 1)
				if err != nil {
					t.Fatal(err)
				}
				defer other.Close()
			}
			tag, err := MakeChannelTag(id, 0)
			if err != nil {
				t.Fatal(err)
			}
			chunk := make([]byte, ChannelChunkSize) // a full chunk: more to come
			sr := ts[1].rawSend(0, id, tag, unsafe.Pointer(&chunk[0]), len(chunk))
			waitUnexpected(ctx, t, ts[0], 1)
			if _, err := sr.Wait(ctx); err != nil {
				t.Fatalf("send of the chunk: %v", err)
			}
			for !prefetchDone(ts[0]) {
				if ctx.Err() != nil {
					t.Fatal("the chunk's prefetch did not end")
				}
				if _, _, err := ts[0].Iprobe(0, 1); err != nil { // enters the transport
					t.Fatal(err)
				}
				runtime.Gosched()
			}
			if n := chunkCounts(ts[0]); n != 1 {
				t.Fatalf("chunk counts after the first chunk: %d, want 1", n)
			}
			if ch == nil {
				c, err := ts[0].Channel(id, 1)
				if err != nil {
					t.Fatal(err)
				}
				ch = c
			}
			if tc.closeFirst {
				if err := ch.Close(); err != nil {
					t.Fatal(err)
				}
			} else {
				defer ch.Close()
			}
			ts[0].rendezvousLost(1, "reported lost by the test")
			if n := chunkCounts(ts[0]); n != 0 {
				t.Fatalf("chunk counts after the sender was lost: %d, want 0", n)
			}
		})
	}
}
