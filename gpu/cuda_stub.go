//go:build !cgo || !linux

package gpu

import "errors"

func openCUDA() (backend, error) {
	return nil, errors.New("gpu: cuda backend needs cgo on linux (dlopen of libcuda.so.1); this binary was built without it")
}

func cudaDriverCheck() error {
	_, err := openCUDA()
	return err
}
