package gpu

import "fmt"

// HostKernel is the body of a kernel of the host backend: Go code that a
// stream runs in order with its other work, over the memory of the buffers
// given to LaunchHost. mem[i] is the memory of the i-th buffer (device,
// managed or pinned), valid only while the kernel runs: it must not be kept,
// and it must not be touched by other goroutines. A non-nil error (or a
// panic, reported as an error) becomes the stream's sticky error, as a
// faulting kernel does on a GPU.
type HostKernel func(mem [][]byte) error

// errCUDAKernels is what LaunchHost reports on the cuda backend.
const errCUDAKernels = "the cuda backend runs device code, not Go: load a module (Device.LoadModule) and Launch its kernels"

// LaunchHost enqueues kernel k on s over bufs and returns at once. The
// kernel runs after all work enqueued on s before it and before all work
// enqueued after it, like a kernel launch on a CUDA stream; it reaches its
// buffers' memory only through its mem argument. Buffers must belong to s's
// system, be alive, and be pinned, device or managed memory (not Go memory:
// a GPU cannot read pageable memory); freeing one after the launch is safe,
// the memory is released once the kernel has run.
//
// Only the host backend runs kernels: there the stream's executor calls k,
// which makes k the host backend's equivalent of a device kernel. On the
// cuda backend LaunchHost reports ErrNotSupported: code on the GPU is device
// code, loaded with Device.LoadModule and started with Launch.
func LaunchHost(s *Stream, k HostKernel, bufs ...Buffer) error {
	if k == nil {
		return fmt.Errorf("gpu: launch: nil kernel")
	}
	for i, b := range bufs {
		if err := b.valid(); err != nil {
			return fmt.Errorf("gpu: launch: buffer %d: %w", i, err)
		}
		if b.a.kind == KindHost {
			return fmt.Errorf("gpu: launch: buffer %d is Go memory (use AllocHost or device memory): %w", i, ErrUnsupportedKind)
		}
	}
	if err := checkStream(s, bufs...); err != nil {
		return fmt.Errorf("gpu: launch: %w", err)
	}
	return s.dev.sys.be.launchHost(s.impl, k, bufs)
}

// launchHost enqueues k to run in stream order over views of bufs.
func (h *hostBackend) launchHost(s streamImpl, k HostKernel, bufs []Buffer) error {
	bufs = append([]Buffer(nil), bufs...)
	return s.(*hostStream).enqueue(func(<-chan struct{}) error {
		mem := make([][]byte, len(bufs))
		for i, b := range bufs {
			mem[i] = b.view()
		}
		err := runKernel(k, mem)
		// The kernel may have written words that stream or host waits watch.
		h.bus.notify()
		return err
	}, bufs...)
}

// loadModule: the host backend runs Go kernels (LaunchHost), not device code.
func (h *hostBackend) loadModule(int, []byte) (moduleImpl, error) {
	return nil, fmt.Errorf("%w: the host backend runs Go kernels (LaunchHost), not device code", ErrNotSupported)
}

// launch is never reached on the host backend: it loads no modules.
func (h *hostBackend) launch(streamImpl, funcImpl, [6]uint32, kernelParams) error {
	return ErrNotSupported
}

// runKernel calls k, turning a panic into an error.
func runKernel(k HostKernel, mem [][]byte) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gpu: host kernel panicked: %v", r)
		}
	}()
	if err := k(mem); err != nil {
		return fmt.Errorf("gpu: host kernel: %w", err)
	}
	return nil
}
