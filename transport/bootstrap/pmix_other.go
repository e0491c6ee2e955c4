//go:build !cgo || !linux

package bootstrap

import "errors"

// PMIxVersion reports that this build has no PMIx backend (it needs cgo on
// linux).
func PMIxVersion() (lib, version string, err error) {
	return "", "", errors.New("bootstrap: pmix: this build has no PMIx backend (it needs cgo on linux)")
}
