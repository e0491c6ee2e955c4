package actor

import (
	"bytes"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// TestSendOrderThroughBundles: while the receiving rank does not keep up
// (its delivery is held in another handler), small actor messages leave in
// bundles (transport/coalesce.go) and larger ones by requests (eager,
// rendezvous, same-host zero copy); all arrive in send order, with their
// bytes, once the receiver goes on.
func TestSendOrderThroughBundles(t *testing.T) {
	// A window the whole flood fits in: the receiver returns nothing while
	// it is held.
	rts := startLocalWith(t, 2, Options{Credits: 1 << 22})
	const holdID = 0x20
	hold, held := make(chan struct{}), make(chan struct{})
	if err := rts[1].Transport().SetAMHandler(holdID, func(*transport.AMMessage) {
		close(held)
		<-hold
	}); err != nil {
		t.Fatal(err)
	}
	sizes := []int{8, 64, 200, 8, 40 << 10, 16, 32, transport.MaxPostAM + 1, 8, 300 << 10}
	const n = 3000
	type got struct {
		n    int
		data []byte
	}
	arrived := make(chan got, n)
	_, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if m, ok := c.Message().(*seqBlob); ok {
			arrived <- got{n: m.N, data: bytes.Clone(m.Data)}
			ReleasePayload(m.Data)
		}
	}), "sink")
	if err != nil {
		t.Fatal(err)
	}
	if err := rts[0].Transport().PostAM(1, holdID, nil, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the holding message never arrived")
	}
	want := func(i int) []byte {
		b := make([]byte, sizes[i%len(sizes)])
		for j := range b {
			b[j] = byte(i + j*7)
		}
		return b
	}
	sink := rts[0].PID(1, "sink")
	for i := 0; i < n; i++ {
		if err := rts[0].Send(sink, &seqBlob{N: i, Data: want(i)}); err != nil {
			t.Fatal(err)
		}
	}
	bundles, msgs := rts[0].Transport().CoalesceStats()
	close(hold)
	for i := 0; i < n; i++ {
		select {
		case g := <-arrived:
			if g.n != i {
				t.Fatalf("message %d arrived as number %d", i, g.n)
			}
			if !bytes.Equal(g.data, want(i)) {
				t.Fatalf("message %d: payload differs", i)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d messages arrived", i, n)
		}
	}
	if bundles == 0 || msgs == 0 {
		t.Fatal("no message left in a bundle: the bundle path went untested")
	}
	t.Logf("%d of %d messages left in %d bundles", msgs, n, bundles)
}
