//go:build !purego

#include "textflag.h"

// func sweepAVX2(v, u *float64, nx, ny, nz, sx, sxy int, r, c7 float64) float64
//
// v and u point at the first point of the box to sweep (a block's whole
// interior, or part of it: Block.SweepPart). Four points per step, in the
// reference's order of operations, each add and the multiply rounded
// separately (no FMA); a row's last nx%4 points one at a time. The
// residual is kept as a vector of running maxima: VMAXPD returns its
// second source when the other is NaN, so, as in the Go loop, a NaN change
// never becomes the residual.
//
// Registers: R14 the plane's first point in u, DI the row's, SI the point's;
// R10 v - u in bytes (a point of v is at (SI)(R10*1)); R8 sx*8, R11 -sx*8,
// R9 sxy*8, R12 -sxy*8; CX nx*8; R13 (nx&^3)*8; AX the end of the row's
// vector part, then of the row; DX rows left in the plane; BX planes left.
// Y0 running maxima (vector part), X5 running maximum (tails), Y14 the |x|
// mask, Y15 c7.
TEXT ·sweepAVX2(SB), NOSPLIT, $0-80
	MOVQ v+0(FP), R10
	MOVQ u+8(FP), R14
	SUBQ R14, R10
	MOVQ nx+16(FP), CX
	MOVQ nz+32(FP), BX
	MOVQ sx+40(FP), R8
	MOVQ sxy+48(FP), R9
	SHLQ $3, R8
	SHLQ $3, R9
	MOVQ R8, R11
	NEGQ R11
	MOVQ R9, R12
	NEGQ R12
	SHLQ $3, CX
	MOVQ CX, R13
	ANDQ $-32, R13
	VBROADCASTSD r+56(FP), Y0
	VMOVSD r+56(FP), X5
	VBROADCASTSD c7+64(FP), Y15
	VPCMPEQQ Y14, Y14, Y14
	VPSRLQ $1, Y14, Y14

plane:
	TESTQ BX, BX
	JLE done
	MOVQ ny+24(FP), DX
	MOVQ R14, DI

row:
	TESTQ DX, DX
	JLE nextplane
	MOVQ DI, SI
	LEAQ (DI)(R13*1), AX

vec:
	CMPQ SI, AX
	JAE tail
	VMOVUPD (SI), Y1
	VADDPD -8(SI), Y1, Y2
	VADDPD 8(SI), Y2, Y2
	VADDPD (SI)(R11*1), Y2, Y2
	VADDPD (SI)(R8*1), Y2, Y2
	VADDPD (SI)(R12*1), Y2, Y2
	VADDPD (SI)(R9*1), Y2, Y2
	VMULPD Y15, Y2, Y2
	VMOVUPD Y2, (SI)(R10*1)
	VSUBPD Y1, Y2, Y3
	VANDPD Y14, Y3, Y3
	VMAXPD Y0, Y3, Y0
	ADDQ $32, SI
	JMP vec

tail:
	LEAQ (DI)(CX*1), AX

tailloop:
	CMPQ SI, AX
	JAE nextrow
	VMOVSD (SI), X1
	VADDSD -8(SI), X1, X2
	VADDSD 8(SI), X2, X2
	VADDSD (SI)(R11*1), X2, X2
	VADDSD (SI)(R8*1), X2, X2
	VADDSD (SI)(R12*1), X2, X2
	VADDSD (SI)(R9*1), X2, X2
	VMULSD X15, X2, X2
	VMOVSD X2, (SI)(R10*1)
	VSUBSD X1, X2, X3
	VANDPD X14, X3, X3
	VMAXSD X5, X3, X5
	ADDQ $8, SI
	JMP tailloop

nextrow:
	ADDQ R8, DI
	DECQ DX
	JMP row

nextplane:
	ADDQ R9, R14
	DECQ BX
	JMP plane

done:
	VEXTRACTF128 $1, Y0, X1
	VMAXPD X1, X0, X0
	VPERMILPD $1, X0, X1
	VMAXPD X1, X0, X0
	VMAXSD X5, X0, X0
	VZEROUPPER
	MOVSD X0, ret+72(FP)
	RET
