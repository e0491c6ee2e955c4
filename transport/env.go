package transport

import "syscall"

func syscallGetenv(k string) (string, bool) { return syscall.Getenv(k) }
