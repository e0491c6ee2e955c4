package ucx_test

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// A worker sends a tagged message to itself: connect to its own address,
// post the receive, send, and progress until the receive's event arrives.
// Real programs serialise every call on a worker in one goroutine, as here.
func ExampleWorker_TagSend() {
	ctx, err := ucx.NewContext(ucx.FeatureTag, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer ctx.Close()
	w, err := ctx.NewWorker(ucx.ThreadSingle)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer w.Close()
	addr, _ := w.Address()
	ep, err := w.Connect(addr, false)
	if err != nil {
		fmt.Println(err)
		return
	}

	msg, got := []byte("hello, troupe"), make([]byte, 64)
	var pin runtime.Pinner // buffers of non-blocking calls stay put until completion
	pin.Pin(&msg[0])
	pin.Pin(&got[0])
	defer pin.Unpin()

	recv, _ := w.TagRecv(ucx.Buffer{Ptr: unsafe.Pointer(&got[0]), Len: len(got)}, 42, ^uint64(0))
	send, _ := w.TagSend(ep, ucx.Buffer{Ptr: unsafe.Pointer(&msg[0]), Len: len(msg)}, 42)
	for sent, received := !send.Pending(), false; !sent || !received; {
		evs, _ := w.Progress()
		for i := range evs {
			switch evs[i].Request() {
			case recv:
				received = true
				fmt.Printf("tag %d: %s\n", evs[i].SenderTag(), got[:evs[i].Length()])
			case send:
				sent = true
			}
		}
	}
	if r, err := w.CloseEndpoint(ep, false); err == nil {
		for done := !r.Pending(); !done; {
			evs, _ := w.Progress()
			for i := range evs {
				done = done || evs[i].Request() == r
			}
		}
	}
	// Output: tag 42: hello, troupe
}
