//go:build amd64 && !purego

package datatype

import (
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/cpu"
)

// hasBlockKernel says whether blocks64 can be used: the AVX2 kernel needs
// the CPU to have AVX2 (and the OS to save the YMM registers, which
// cpu.X86.HasAVX2 includes).
var hasBlockKernel = cpu.X86.HasAVX2

// hasRepKernel says whether blocksRep can be used: the CPU has enhanced
// REP MOVSB. Whether it is used is repKernelOn.
var hasRepKernel = cpu.X86.HasERMS

// repKernelOn says whether blocks of repKernelMin to repKernelMax bytes move
// with blocksRep (SetRepKernel); by default where repFaster judges this CPU.
var repKernelOn atomic.Bool

func init() {
	vendor, family, model := cpuModel()
	repKernelOn.Store(repFaster(vendor, family, model, hasRepKernel))
}

// repKernel reports whether blocksRep is in use.
func repKernel() bool { return repKernelOn.Load() }

// setRepKernel turns blocksRep on (where the CPU has it) or off.
func setRepKernel(on bool) bool {
	on = on && hasRepKernel
	repKernelOn.Store(on)
	return on
}

// cpuid executes CPUID with leaf eaxArg and subleaf ecxArg. Implemented in
// kernel_amd64.s.
//
//go:noescape
func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)

// cpuModel returns the CPU's vendor string and its display family and
// model (CPUID leaves 0 and 1, with the extended fields folded in as the
// vendors' manuals define).
func cpuModel() (vendor string, family, model uint32) {
	_, b, c, d := cpuid(0, 0)
	v := make([]byte, 0, 12)
	for _, r := range []uint32{b, d, c} {
		v = append(v, byte(r), byte(r>>8), byte(r>>16), byte(r>>24))
	}
	a, _, _, _ := cpuid(1, 0)
	family, model = a>>8&0xf, a>>4&0xf
	if family == 0xf {
		family += a >> 20 & 0xff
	}
	if family == 0x6 || family >= 0xf {
		model |= (a >> 16 & 0xf) << 4
	}
	return string(v), family, model
}

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
