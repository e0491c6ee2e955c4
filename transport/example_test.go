package transport_test

import (
	"context"
	"fmt"
	"time"
	"unsafe"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// Two ranks in one process exchange a tagged message through UCX, as two MPI
// ranks would with MPI_Send and MPI_Recv. A real job gets its transport from
// transport.New under `troupe run` instead of StartLocal.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	const tag = 5
	sent := make(chan error, 1)
	go func() { sent <- ts[0].Send(ctx, 1, tag, []byte("hello, rank 1")) }()

	buf := make([]byte, 64)
	st, err := ts[1].Recv(ctx, 0, tag, buf)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := <-sent; err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("rank %d got %q from rank %d, tag %d\n", ts[1].Rank(), buf[:st.Size], st.Source, st.Tag)
	// Output: rank 1 got "hello, rank 1" from rank 0, tag 5
}

// Irecv posts a receive and returns at once; Wait completes it. A receive
// buffer smaller than the message is an error that names both sizes, and
// the rank goes on.
func ExampleTransport_Irecv() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	small := make([]byte, 4)
	r, err := ts[1].Irecv(0, 1, small)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := ts[0].Send(ctx, 1, 1, []byte("eight by")); err != nil {
		fmt.Println(err)
		return
	}
	_, err = r.Wait(ctx)
	fmt.Println(err)

	// The transport still works: the same pair exchanges the next message.
	r, _ = ts[1].Irecv(0, 1, make([]byte, 8))
	if err := ts[0].Send(ctx, 1, 1, []byte("eight by")); err != nil {
		fmt.Println(err)
		return
	}
	st, err := r.Wait(ctx)
	fmt.Println(st.Size, err)
	// Output:
	// transport: message from rank 0 tag 1 is 8 bytes, receive buffer holds 4: truncated
	// 8 <nil>
}

// A master collects one result from each worker in whatever order they
// finish, as with MPI_ANY_SOURCE: the Status of each receive names the
// worker it came from.
func ExampleAnySource() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 3, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	const result = 2
	for w := 1; w <= 2; w++ {
		go func(w int) { _ = ts[w].Send(ctx, 0, result, []byte{byte(w * w)}) }(w)
	}
	sum := 0
	from := map[int]bool{}
	buf := make([]byte, 1)
	for range 2 {
		st, err := ts[0].Recv(ctx, transport.AnySource, result, buf)
		if err != nil {
			fmt.Println(err)
			return
		}
		from[st.Source] = true
		sum += int(buf[0])
	}
	fmt.Println("sum", sum, "from ranks 1 and 2:", from[1] && from[2])
	// Output: sum 5 from ranks 1 and 2: true
}

// A receiver that does not know how large the next message is learns its
// size with a matched probe, allocates exactly that, and receives that very
// message: unlike Probe followed by Recv, no other goroutine's receive can
// take it in between (MPI_Mprobe and MPI_Mrecv).
func ExampleTransport_Mprobe() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	const report = 3
	go func() { _ = ts[1].Send(ctx, 0, report, []byte("a report of unknown length")) }()
	m, err := ts[0].Mprobe(ctx, transport.AnySource, report)
	if err != nil {
		fmt.Println(err)
		return
	}
	buf := make([]byte, m.Status().Size)
	st, err := m.Recv(ctx, buf)
	fmt.Printf("%d bytes from rank %d: %q %v\n", st.Size, st.Source, buf, err)
	// Output: 26 bytes from rank 1: "a report of unknown length" <nil>
}

// SendTyped sends a column of a row-major matrix, described by a derived
// datatype, without packing it by hand; here it lands in a contiguous
// buffer on the other rank. Both sides' type signatures must match (four
// float64 here), not their layouts.
func ExampleTransport_SendTyped() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	// A 4x4 matrix of float64; column 2 is 4 elements, 4 apart.
	matrix := make([]float64, 16)
	for i := range matrix {
		matrix[i] = float64(i)
	}
	col, err := datatype.Vector(4, 1, 4, datatype.Float64)
	if err != nil {
		fmt.Println(err)
		return
	}
	contig, _ := datatype.Contiguous(4, datatype.Float64)

	got := make([]float64, 4)
	r, err := ts[1].IrecvTyped(0, 3, float64Bytes(got), contig, 1)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := ts[0].SendTyped(ctx, 1, 3, float64Bytes(matrix[2:]), col, 1); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := r.Wait(ctx); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(got)
	// Output: [2 6 10 14]
}

// Two ranks swap a matrix column each, MPI style: post the receive and the
// send, then wait for both. A small nonblocking typed request starts when
// it is needed; a Wait with a context that cannot end runs it in the
// waiting goroutine, after starting the other requests the peer may need
// (docs/noncontig.md, "Nonblocking typed calls").
func ExampleTransport_IsendTyped() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	col, err := datatype.Vector(4, 1, 4, datatype.Float64) // a column of a 4x4 matrix
	if err != nil {
		fmt.Println(err)
		return
	}
	got := make([][]float64, 2)
	done := make(chan error, 2)
	for r, tr := range ts {
		go func() {
			matrix := make([]float64, 16)
			for i := range matrix {
				matrix[i] = float64(100*r + i)
			}
			peer := 1 - r
			recv, err := tr.IrecvTyped(peer, 5, float64Bytes(matrix[0:]), col, 1) // into column 0
			if err != nil {
				done <- err
				return
			}
			send, err := tr.IsendTyped(peer, 5, float64Bytes(matrix[3:]), col, 1) // column 3
			if err != nil {
				done <- err
				return
			}
			for _, q := range []*transport.Request{recv, send} {
				if _, err := q.Wait(context.Background()); err != nil {
					done <- err
					return
				}
			}
			got[r] = []float64{matrix[0], matrix[4], matrix[8], matrix[12]}
			done <- nil
		}()
	}
	for range ts {
		if err := <-done; err != nil {
			fmt.Println(err)
			return
		}
	}
	fmt.Println(got[0], got[1])
	// Output: [103 107 111 115] [3 7 11 15]
}

// A receiver that does not know how much data a typed message carries
// probes it first (MPI_Mprobe), counts the elements (MPI_Get_count), sizes
// its buffer and receives the probed message (MPI_Mrecv), which no other
// receive can take meanwhile.
func ExampleTransport_MprobeTyped() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	// Every other element of ten float64: five of them.
	data := []float64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}
	evens, err := datatype.Vector(5, 1, 2, datatype.Float64)
	if err != nil {
		fmt.Println(err)
		return
	}
	sent := make(chan error, 1)
	go func() { sent <- ts[0].SendTyped(ctx, 1, 4, float64Bytes(data), evens, 1) }()

	m, err := ts[1].MprobeTyped(ctx, transport.AnySource, 4)
	if err != nil {
		fmt.Println(err)
		return
	}
	n, ok := m.Count(datatype.Float64)
	if !ok {
		fmt.Println("not a whole number of float64")
		return
	}
	got := make([]float64, n)
	if _, err := m.Recv(ctx, float64Bytes(got), datatype.Float64, n); err != nil {
		fmt.Println(err)
		return
	}
	if err := <-sent; err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d elements from rank %d: %v\n", n, m.Status().Source, got)
	// Output: 5 elements from rank 0: [0 2 4 6 8]
}

// A channel pairs the n-th Send of one end with the n-th Recv of the other,
// with no metadata message; Send and Recv return futures.
func ExampleTransport_Channel() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	a, err := ts[0].Channel(42, 1) // rank 0's end, towards rank 1
	if err != nil {
		fmt.Println(err)
		return
	}
	defer a.Close()
	b, err := ts[1].Channel(42, 0) // rank 1's end, towards rank 0
	if err != nil {
		fmt.Println(err)
		return
	}
	defer b.Close()

	first, second := make([]byte, 5), make([]byte, 5)
	r1, _ := b.RecvBytes(first)
	r2, _ := b.RecvBytes(second)
	s1, _ := a.SendBytes([]byte("first"))
	s2, _ := a.SendBytes([]byte("later"))
	for _, r := range []*transport.ChannelRequest{s1, s2, r1, r2} {
		if err := r.Wait(ctx); err != nil {
			fmt.Println(err)
			return
		}
	}
	fmt.Println(string(first), string(second))
	// Output: first later
}

// A column of a 4x4 row-major matrix in device memory goes over a channel
// into a contiguous device buffer: the channel packs it on the device and
// sends the packed bytes. The host backend stands in for a GPU here.
func ExampleChannel_SendTyped() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sys.Close()
	dev := sys.Devices()[0]

	a, _ := ts[0].Channel(7, 1)
	b, _ := ts[1].Channel(7, 0)
	defer a.Close()
	defer b.Close()

	matrix := make([]byte, 16)
	for i := range matrix {
		matrix[i] = byte(i) // row r, column c holds 4r+c
	}
	src, _ := dev.Alloc(16)
	_ = gpu.CopyFromHost(src, matrix)
	dst, _ := dev.Alloc(4)
	column, _ := datatype.Vector(4, 1, 4, datatype.Uint8) // column 0

	rr, err := b.RecvTyped(dst, datatype.Uint8, 4) // four bytes in a row
	if err != nil {
		fmt.Println(err)
		return
	}
	sr, err := a.SendTyped(src, column, 1)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := sr.Wait(ctx); err != nil {
		fmt.Println(err)
		return
	}
	if err := rr.Wait(ctx); err != nil {
		fmt.Println(err)
		return
	}
	got := make([]byte, 4)
	_ = gpu.CopyToHost(got, dst)
	fmt.Println(got, ts[0].ChannelTypedStats().DevicePacked)
	// Output: [0 4 8 12] 1
}

// One-sided access: rank 1 registers memory and ships its key; rank 0 puts
// into it and gets from it without rank 1's participation.
func ExampleTransport_Put() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	window := []byte("................")
	reg, err := ts[1].Register(window)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer reg.Release()
	wire, _ := reg.Key().MarshalBinary() // sent to rank 0 in any message

	var key transport.RemoteKey
	if err := key.UnmarshalBinary(wire); err != nil {
		fmt.Println(err)
		return
	}
	if err := ts[0].Put(ctx, key, 4, []byte("RDMA")); err != nil {
		fmt.Println(err)
		return
	}
	if err := ts[0].Flush(ctx, 1); err != nil {
		fmt.Println(err)
		return
	}
	back := make([]byte, 8)
	if err := ts[0].Get(ctx, key, 2, back); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s\n%s\n", window, back)
	// Put outside the region fails before anything moves.
	fmt.Println(ts[0].Put(ctx, key, 14, []byte("RDMA")) != nil)
	// Output:
	// ....RDMA........
	// ..RDMA..
	// true
}

// float64Bytes views f's memory as bytes, as the typed calls take it.
func float64Bytes(f []float64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 8*len(f))
}

// Sendrecv exchanges messages with both neighbours of a ring in one call,
// as MPI_Sendrecv does: every rank sends to its right and receives from
// its left, without the deadlock a blocking send then receive risks.
func ExampleTransport_Sendrecv() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 3
	ts, stop, err := transport.StartLocal(ctx, n, transport.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	got := make([][]byte, n)
	errs := make(chan error, n)
	for r := range n {
		go func() {
			got[r] = make([]byte, 16)
			msg := fmt.Sprintf("from rank %d", r)
			st, err := ts[r].Sendrecv(ctx, (r+1)%n, 0, []byte(msg), (r+n-1)%n, 0, got[r])
			got[r] = got[r][:st.Size]
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			fmt.Println(err)
			return
		}
	}
	for r := range n {
		fmt.Printf("rank %d: %s\n", r, got[r])
	}
	// Output:
	// rank 0: from rank 2
	// rank 1: from rank 0
	// rank 2: from rank 1
}
