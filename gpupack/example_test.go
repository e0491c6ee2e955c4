package gpupack_test

import (
	"fmt"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/gpupack"
)

// Pack a column of a 4x4 matrix of int32 that lives in device memory into
// a contiguous device buffer (ready for a channel or a GPU message), in
// stream order, and read it back.
func Example() {
	sys, err := gpu.OpenBackend("host") // gpu.Open() picks cuda where there is a GPU
	if err != nil {
		panic(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	p, err := gpupack.New(dev, gpupack.Options{})
	if err != nil {
		panic(err)
	}
	defer p.Close()
	st, _ := dev.NewStream()
	defer st.Destroy()

	column, _ := datatype.Vector(4, 1, 4, datatype.Int32) // one int32 per row, rows 16 bytes apart
	_ = column.Commit()
	matrix := make([]byte, 64)
	for i := range matrix {
		matrix[i] = byte(i) // int32 element e holds bytes 4e..4e+3
	}
	user, _ := dev.Alloc(len(matrix))
	defer gpu.Free(user)
	packed, _ := dev.Alloc(16)
	defer gpu.Free(packed)
	_ = gpu.CopyFromHost(user, matrix)

	// Column 1: its origin is at byte 4 of the matrix.
	n, err := p.Pack(st, packed, user, column, 4, 1)
	if err != nil {
		panic(err)
	}
	_ = st.Synchronize()
	out := make([]byte, n)
	_ = gpu.CopyToHost(out, packed)
	fmt.Println(n, out)
	// Output:
	// 16 [4 5 6 7 20 21 22 23 36 37 38 39 52 53 54 55]
}
