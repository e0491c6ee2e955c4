//go:build amd64 && !purego

package datatype

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// hasBlockKernel says whether blocks64 can be used: the AVX2 kernel needs
// the CPU to have AVX2 (and the OS to save the YMM registers, which
// cpu.X86.HasAVX2 includes).
var hasBlockKernel = cpu.X86.HasAVX2

// blocks64 copies n blocks of l > 64 bytes, the i-th from src + i*srcStride
// to dst + i*dstStride, with 32-byte AVX2 moves. It never touches a byte
// outside the blocks. Implemented in kernel_amd64.s.
//
//go:noescape
func blocks64(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64)
