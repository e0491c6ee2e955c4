package gpu_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/troupe-hpc/troupe/gpu"
)

// Allocate device memory, fill it from Go memory, and read it back with
// explicit copies: device memory is never exposed as a Go slice.
func Example() {
	sys, err := gpu.OpenBackend("host") // gpu.Open() honours TROUPE_GPU
	if err != nil {
		panic(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]

	buf, err := dev.Alloc(8)
	if err != nil {
		panic(err)
	}
	defer gpu.Free(buf)
	if err := gpu.CopyFromHost(buf, []byte("troupe!!")); err != nil {
		panic(err)
	}
	kind, owner := sys.KindOf(buf.Ptr())
	out := make([]byte, 4)
	head, _ := buf.Slice(0, 4)
	if err := gpu.CopyToHost(out, head); err != nil {
		panic(err)
	}
	_, err = buf.Bytes()
	fmt.Println(kind, owner == dev, string(out))
	fmt.Println(err != nil)
	// Output:
	// device true trou
	// true
}

// Stream B waits for a flag that stream A writes after producing data; the
// host only enqueues and never blocks until it synchronizes.
func ExampleWaitValue64() {
	sys, _ := gpu.OpenBackend("host")
	defer sys.Close()
	dev := sys.Devices()[0]
	a, _ := dev.NewStream()
	b, _ := dev.NewStream()

	flag, _ := sys.AllocHost(8)
	data, _ := dev.Alloc(4)
	out, _ := sys.AllocHost(4)

	// Consumer first: it waits on the stream, not on the host.
	_ = gpu.WaitValue64(b, flag, 1, gpu.GEQ)
	_ = gpu.CopyAsync(b, out, data)

	// Producer.
	_ = gpu.MemsetAsync(a, data, 'x')
	_ = gpu.WriteValue64(a, flag, 1)

	_ = b.Synchronize()
	p, _ := out.Bytes()
	fmt.Println(string(p))
	// Output: xxxx
}

// A host agent (for example a progress engine) waits for a trigger counter
// written by a stream and answers with a completion counter the stream waits
// on.
func ExampleWaitValue64Host() {
	sys, _ := gpu.OpenBackend("host")
	defer sys.Close()
	st, _ := sys.Devices()[0].NewStream()
	counters, _ := sys.AllocHost(16)
	trigger, _ := counters.Slice(0, 8)
	completion, _ := counters.Slice(8, 8)

	_ = gpu.WriteValue64(st, trigger, 1)            // "start"
	_ = gpu.WaitValue64(st, completion, 1, gpu.GEQ) // "wait"

	go func() {
		_ = gpu.WaitValue64Host(context.Background(), trigger, 1, gpu.GEQ)
		// ... issue the communication, then:
		_ = gpu.WriteValue64Host(completion, 1)
	}()
	fmt.Println(st.Synchronize())
	// Output: <nil>
}

// Pinned staging buffers come from a bounded pool.
func ExamplePinnedPool() {
	sys, _ := gpu.OpenBackend("host")
	defer sys.Close()
	pool, _ := sys.NewPinnedPool(gpu.PoolConfig{MinSize: 4096, MaxSize: 1 << 20, MaxBytes: 4 << 20})
	defer pool.Close()
	b, _ := pool.Get(10000)
	fmt.Println(b.Kind(), b.Len())
	_ = pool.Put(b)
	held, inUse, idle := pool.Stats()
	fmt.Println(held, inUse, idle)
	// Output:
	// pinned 10000
	// 16384 0 1
}

// A host-backend kernel: Go code that runs on a stream, in order with the
// copies around it, over device memory it reaches only through its
// arguments. On the cuda backend LaunchHost reports gpu.ErrNotSupported.
func ExampleLaunchHost() {
	sys, _ := gpu.OpenBackend("host")
	defer sys.Close()
	dev := sys.Devices()[0]
	st, _ := dev.NewStream()
	in, _ := dev.Alloc(5)
	out, _ := dev.Alloc(5)
	host, _ := sys.AllocHost(5)

	_ = gpu.CopyFromHost(in, []byte("hello"))
	// out[i] = upper(in[i]), in stream order.
	_ = gpu.LaunchHost(st, func(mem [][]byte) error {
		src, dst := mem[0], mem[1]
		for i, c := range src {
			dst[i] = c - 'a' + 'A'
		}
		return nil
	}, in, out)
	_ = gpu.CopyAsync(st, host, out) // runs after the kernel
	_ = st.Synchronize()
	p, _ := host.Bytes()
	fmt.Println(string(p))
	// Output: HELLO
}

// Load device code and launch a kernel on the cuda backend (this example is
// compiled, not run: it needs a GPU). ptx is what clang makes of a kernel
// written in the dialect of gpu/troupe_kernel.h, here
//
//	typedef struct { double *x; double a; long long n; } ScaleArgs;
//	TROUPE_KERNEL(scale, ScaleArgs, p) {
//		long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
//		if (i < p.n) p.x[i] *= p.a;
//	}
func ExampleLaunch() {
	var ptx []byte // e.g. //go:embed scale.ptx
	sys, err := gpu.OpenBackend(gpu.BackendCUDA)
	if err != nil {
		panic(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	m, err := dev.LoadModule(ptx)
	if err != nil {
		panic(err)
	}
	defer m.Unload()
	scale, err := m.Function("scale")
	if err != nil {
		panic(err)
	}
	const n = 1 << 20
	x, err := dev.Alloc(8 * n)
	if err != nil {
		panic(err)
	}
	defer gpu.Free(x)
	st, err := dev.NewStream()
	if err != nil {
		panic(err)
	}
	defer st.Destroy()
	// The kernel's one parameter is a struct of three 8-byte fields.
	args := binary.LittleEndian.AppendUint64(nil, uint64(x.Ptr()))
	args = binary.LittleEndian.AppendUint64(args, math.Float64bits(0.5))
	args = binary.LittleEndian.AppendUint64(args, n)
	if err := gpu.Launch(st, scale, gpu.Dim3{X: n / 256}, gpu.Dim3{X: 256}, args); err != nil {
		panic(err)
	}
	if err := st.Synchronize(); err != nil {
		panic(err)
	}
}
