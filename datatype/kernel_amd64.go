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

// hasRepKernel says whether blocksRep is used for blocks of repKernelMin to
// repKernelMax bytes: only on CPUs with enhanced REP MOVSB.
var hasRepKernel = cpu.X86.HasERMS

// blocksRep copies n blocks of l bytes, the i-th from src + i*srcStride to
// dst + i*dstStride, with one REP MOVSB per block. Implemented in
// kernel_amd64.s.
//
//go:noescape
func blocksRep(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64)

// blocks64 copies n blocks of l > 64 bytes, the i-th from src + i*srcStride
// to dst + i*dstStride, with 32-byte AVX2 moves. It never touches a byte
// outside the blocks. Implemented in kernel_amd64.s.
//
//go:noescape
func blocks64(dst, src unsafe.Pointer, n, l, dstStride, srcStride int64)
