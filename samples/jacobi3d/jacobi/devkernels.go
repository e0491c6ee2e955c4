package jacobi

import (
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/troupe-hpc/troupe/gpu"
)

// This file holds the -gpu mode's kernels in their two forms: Go kernels
// (gpu.LaunchHost) on a backend that runs them (host), and the device code
// of kernels.cu, embedded as PTX, on a backend that runs device code
// (cuda). Both compute exactly what Block's Sweep, PackFaceTo and
// UnpackFace compute.

// kernelsPTX is kernels.cu compiled for the GPU (`make ptx`).
//
//go:embed kernels.ptx
var kernelsPTX []byte

// stencil launches a rank's kernels on its device: dk is nil on a backend
// that runs Go kernels.
type stencil struct {
	dk *deviceKernels
}

// deviceKernels are kernels.cu's kernels loaded on one device.
type deviceKernels struct {
	m           *gpu.Module
	sweep, face *gpu.Function
}

// newStencil picks the kernels dev's backend runs: Go kernels where
// gpu.LaunchHost works, else the device code of kernels.cu.
func newStencil(dev *gpu.Device) (*stencil, error) {
	st, err := dev.NewStream()
	if err != nil {
		return nil, err
	}
	defer st.Destroy()
	err = gpu.LaunchHost(st, func([][]byte) error { return nil })
	if err == nil {
		if err = st.Synchronize(); err == nil {
			return &stencil{}, nil
		}
	}
	if !errors.Is(err, gpu.ErrNotSupported) {
		return nil, err
	}
	m, lerr := dev.LoadModule(kernelsPTX)
	if lerr != nil {
		return nil, fmt.Errorf("the backend runs neither Go kernels (%v) nor the stencil's device code: %w", err, lerr)
	}
	dk := &deviceKernels{m: m}
	if dk.sweep, err = m.Function("jacobi_sweep"); err == nil {
		dk.face, err = m.Function("jacobi_face")
	}
	if err != nil {
		_ = m.Unload()
		return nil, err
	}
	return &stencil{dk: dk}, nil
}

// release unloads the device code, if any.
func (s *stencil) release() error {
	if s == nil || s.dk == nil {
		return nil
	}
	return s.dk.m.Unload()
}

// kernelArgs lays out a kernel's by-value struct of 8-byte fields.
func kernelArgs(fields ...uint64) []byte {
	out := make([]byte, 0, 8*len(fields))
	for _, f := range fields {
		out = binary.LittleEndian.AppendUint64(out, f)
	}
	return out
}

// blocksFor is the number of blocks of size b that cover n threads.
func blocksFor(n, b int) int { return (n + b - 1) / b }

// sweep enqueues on st the sweep of geo from field u into v, leaving the
// residual's float64 bits in res (8 bytes of device memory).
func (s *stencil) sweep(st *gpu.Stream, geo Block, u, v, res gpu.Buffer) error {
	if s.dk == nil {
		return gpu.LaunchHost(st, func(mem [][]byte) error {
			u, err := float64View(mem[0])
			if err != nil {
				return err
			}
			v, err := float64View(mem[1])
			if err != nil {
				return err
			}
			r := geo.Sweep(u, v)
			binary.LittleEndian.PutUint64(mem[2], math.Float64bits(r))
			return nil
		}, u, v, res)
	}
	if err := gpu.MemsetAsync(st, res, 0); err != nil {
		return err
	}
	block := gpu.Dim3{X: 32, Y: 4, Z: 2}
	grid := gpu.Dim3{X: blocksFor(geo.NX, block.X), Y: blocksFor(geo.NY, block.Y), Z: blocksFor(geo.NZ, block.Z)}
	return gpu.Launch(st, s.dk.sweep, grid, block, kernelArgs(
		uint64(u.Ptr()), uint64(v.Ptr()), uint64(res.Ptr()),
		uint64(geo.NX), uint64(geo.NY), uint64(geo.NZ), uint64(geo.SX), uint64(geo.SXY),
		math.Float64bits(C7)))
}

// faces enqueues on st, for each direction dirs[i], the packing of u's
// plane next to face dirs[i] into bufs[i] (pack), or the unpacking of
// bufs[i] into u's ghost plane of face dirs[i] (!pack).
func (s *stencil) faces(st *gpu.Stream, geo Block, pack bool, u gpu.Buffer, dirs []int, bufs []gpu.Buffer) error {
	if len(dirs) == 0 {
		return nil
	}
	if s.dk == nil {
		return gpu.LaunchHost(st, func(mem [][]byte) error {
			u, err := float64View(mem[0])
			if err != nil {
				return err
			}
			for i, d := range dirs {
				f, err := float64View(mem[i+1])
				if err != nil {
					return err
				}
				if pack {
					err = geo.PackFaceTo(f, u, d)
				} else {
					err = geo.UnpackFace(u, d, f)
				}
				if err != nil {
					return err
				}
			}
			return nil
		}, append([]gpu.Buffer{u}, bufs...)...)
	}
	block := gpu.Dim3{X: 32, Y: 8}
	for i, d := range dirs {
		if want := geo.FaceLen(d) * 8; bufs[i].Len() != want {
			return fmt.Errorf("jacobi: face %d buffer has %d bytes, want %d", d, bufs[i].Len(), want)
		}
		p := geo.plane(d, pack)
		var flag uint64
		if pack {
			flag = 1
		}
		grid := gpu.Dim3{X: blocksFor(p.n1, block.X), Y: blocksFor(p.n2, block.Y)}
		err := gpu.Launch(st, s.dk.face, grid, block, kernelArgs(
			uint64(u.Ptr()), uint64(bufs[i].Ptr()),
			uint64(p.base), uint64(p.s1), uint64(p.s2), uint64(p.n1), uint64(p.n2), flag))
		if err != nil {
			return err
		}
	}
	return nil
}
