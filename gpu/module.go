package gpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
)

// Module is device code loaded on one device: a PTX image that the driver
// compiles for the device when it is loaded (cuModuleLoadDataEx). Only the
// cuda backend loads modules; the host backend runs Go kernels instead
// (LaunchHost). A Module is safe for concurrent use.
type Module struct {
	dev  *Device
	impl moduleImpl

	mu       sync.Mutex
	funcs    map[string]*Function
	unloaded atomic.Bool
}

// Function is one kernel (a .entry of the PTX image) of a Module.
type Function struct {
	m    *Module
	name string
	impl funcImpl
}

// Dim3 is a grid or block size in threads or blocks, as in CUDA's dim3. A
// zero field counts as 1.
type Dim3 struct{ X, Y, Z int }

// moduleImpl and funcImpl are a backend's loaded module and kernel handle.
type moduleImpl interface {
	function(name string) (funcImpl, error)
	unload() error
}

type funcImpl any

// LoadModule loads a PTX image (text, as clang or nvcc emit it with -S or
// -ptx) on the device. A JIT compilation failure is an error carrying the
// driver's log. The host backend reports ErrNotSupported.
//
// The driver's load waits for all of the device's work, a resident copy
// agent (agent.go) included: the agent is made to return first.
func (d *Device) LoadModule(ptx []byte) (*Module, error) {
	if err := d.sys.check(); err != nil {
		return nil, err
	}
	d.agent.quiesce()
	return d.loadModule(ptx)
}

// loadModule is LoadModule without making the copy agent return (the
// agent's own setup, which holds the agent's lock).
func (d *Device) loadModule(ptx []byte) (*Module, error) {
	if err := d.sys.check(); err != nil {
		return nil, err
	}
	if len(ptx) == 0 {
		return nil, fmt.Errorf("gpu: load module on %v: empty image", d)
	}
	impl, err := d.sys.be.loadModule(d.ord, ptx)
	if err != nil {
		return nil, fmt.Errorf("gpu: load module on %v: %w", d, err)
	}
	return &Module{dev: d, impl: impl, funcs: map[string]*Function{}}, nil
}

// Device returns the device the module is loaded on.
func (m *Module) Device() *Device { return m.dev }

func (m *Module) check() error {
	if err := m.dev.sys.check(); err != nil {
		return err
	}
	if m.unloaded.Load() {
		return fmt.Errorf("gpu: module: %w", ErrDestroyed)
	}
	return nil
}

// Function returns the kernel called name (its extern "C" name), looked up
// once and cached.
func (m *Module) Function(name string) (*Function, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if f := m.funcs[name]; f != nil {
		return f, nil
	}
	impl, err := m.impl.function(name)
	if err != nil {
		return nil, fmt.Errorf("gpu: kernel %q: %w", name, err)
	}
	f := &Function{m: m, name: name, impl: impl}
	m.funcs[name] = f
	return f, nil
}

// Unload releases the module; its Functions may no longer be launched.
// Kernels already launched finish first (the driver waits for them, and
// for all of the device's work: a resident copy agent is made to return
// first).
func (m *Module) Unload() error {
	return m.unload(true)
}

// unload is Unload; quiesce false leaves the copy agent alone (the agent's
// own setup, which holds the agent's lock).
func (m *Module) unload(quiesce bool) error {
	if err := m.check(); err != nil {
		return err
	}
	if !m.unloaded.CompareAndSwap(false, true) {
		return fmt.Errorf("gpu: module: %w", ErrDestroyed)
	}
	if quiesce {
		m.dev.agent.quiesce()
	}
	return m.impl.unload()
}

// Name returns the kernel's name.
func (f *Function) Name() string { return f.name }

// Launch enqueues kernel f on stream s with grid blocks of block threads and
// returns at once; the kernel runs in stream order, like every operation of
// s. The stream must be on the module's device.
//
// Each argument is one kernel parameter, marshalled as the C type the
// kernel declares:
//
//	Buffer                       a pointer (device, managed or pinned memory
//	                             of s's system; not Go memory)
//	int32, uint32, float32       4 bytes
//	int64, uint64, float64       8 bytes
//	[]byte                       a parameter passed by value (a struct, laid
//	                             out by the caller as C lays it out; at most
//	                             8-byte alignment)
//
// A plain int is refused: its C width would be a guess. The argument count
// and sizes must match the kernel's signature; the driver cannot check
// them, so a mismatch is undefined behaviour on the GPU, as in CUDA.
func Launch(s *Stream, f *Function, grid, block Dim3, args ...any) error {
	if f == nil {
		return fmt.Errorf("gpu: launch: nil kernel")
	}
	if err := f.m.check(); err != nil {
		return fmt.Errorf("gpu: launch %s: %w", f.name, err)
	}
	if err := s.check(); err != nil {
		return fmt.Errorf("gpu: launch %s: %w", f.name, err)
	}
	if s.dev != f.m.dev {
		return fmt.Errorf("gpu: launch %s: stream on %v, module on %v: %w", f.name, s.dev, f.m.dev, ErrForeign)
	}
	dims, err := launchDims(grid, block)
	if err != nil {
		return fmt.Errorf("gpu: launch %s: %w", f.name, err)
	}
	p, err := marshalParams(s, args)
	if err != nil {
		return fmt.Errorf("gpu: launch %s: %w", f.name, err)
	}
	return s.dev.sys.be.launch(s.impl, f.impl, dims, p)
}

// launchDims checks grid and block and returns them as CUDA's six launch
// dimensions (grid x, y, z, block x, y, z), zero fields counting as 1.
func launchDims(grid, block Dim3) ([6]uint32, error) {
	var out [6]uint32
	threads := 1
	for i, v := range []int{grid.X, grid.Y, grid.Z, block.X, block.Y, block.Z} {
		if v == 0 {
			v = 1
		}
		if v < 0 || v > math.MaxUint32 {
			return out, fmt.Errorf("grid %+v, block %+v: dimension %d out of range", grid, block, v)
		}
		if i >= 3 {
			// Checked at every step: a product of three dimensions up to
			// 2^32 each can wrap around to a small number.
			if threads *= v; threads > 1024 {
				return out, fmt.Errorf("block %+v has more than 1024 threads, the most CUDA allows", block)
			}
		}
		out[i] = uint32(v)
	}
	return out, nil
}

// kernelParams are a launch's marshalled parameters: parameter i is at
// data[offs[i]:]; bufs are the Buffers among them.
type kernelParams struct {
	data []byte
	offs []int
	bufs []Buffer
}

// maxKernelParams is the most parameters a launch passes (the loader's
// TR_MAX_PARAMS).
const maxKernelParams = 64

// maxParamBytes bounds a launch's parameters (CUDA allows 4 KiB on older
// devices).
const maxParamBytes = 4096

// marshalParams lays the arguments out for a launch on s (see Launch).
func marshalParams(s *Stream, args []any) (kernelParams, error) {
	var p kernelParams
	if len(args) > maxKernelParams {
		return p, fmt.Errorf("%d parameters; at most %d", len(args), maxKernelParams)
	}
	put := func(align int, b []byte) {
		for len(p.data)%align != 0 {
			p.data = append(p.data, 0)
		}
		p.offs = append(p.offs, len(p.data))
		p.data = append(p.data, b...)
	}
	for i, a := range args {
		switch v := a.(type) {
		case Buffer:
			if err := v.valid(); err != nil {
				return p, fmt.Errorf("parameter %d: %w", i, err)
			}
			if v.a.sys != s.dev.sys {
				return p, fmt.Errorf("parameter %d: %w", i, ErrForeign)
			}
			if v.a.kind == KindHost {
				return p, fmt.Errorf("parameter %d is Go memory (use AllocHost or device memory): %w", i, ErrUnsupportedKind)
			}
			if v.a.kind == KindDevice && v.a.dev != s.dev {
				return p, fmt.Errorf("parameter %d is memory of %v, the kernel runs on %v: %w", i, v.a.dev, s.dev, ErrForeign)
			}
			put(8, binary.LittleEndian.AppendUint64(nil, uint64(v.ptr)))
			p.bufs = append(p.bufs, v)
		case int32:
			put(4, binary.LittleEndian.AppendUint32(nil, uint32(v)))
		case uint32:
			put(4, binary.LittleEndian.AppendUint32(nil, v))
		case float32:
			put(4, binary.LittleEndian.AppendUint32(nil, math.Float32bits(v)))
		case int64:
			put(8, binary.LittleEndian.AppendUint64(nil, uint64(v)))
		case uint64:
			put(8, binary.LittleEndian.AppendUint64(nil, v))
		case float64:
			put(8, binary.LittleEndian.AppendUint64(nil, math.Float64bits(v)))
		case []byte:
			if len(v) == 0 {
				return p, fmt.Errorf("parameter %d: empty by-value parameter", i)
			}
			put(8, v)
		default:
			return p, fmt.Errorf("parameter %d: type %T cannot be a kernel parameter (use a Buffer, a sized number or []byte)", i, a)
		}
		if len(p.data) > maxParamBytes {
			return p, fmt.Errorf("parameters exceed %d bytes", maxParamBytes)
		}
	}
	return p, nil
}
