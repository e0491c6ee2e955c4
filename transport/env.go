package transport

import "syscall"

func syscallGetenv(k string) (string, bool) { return syscall.Getenv(k) }

func syscallSetenv(k, v string) error { return syscall.Setenv(k, v) }
