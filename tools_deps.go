//go:build tools

package main

import (
	_ "github.com/asynkron/protoactor-go/actor"
	_ "github.com/schollz/progressbar/v3"
	_ "github.com/spf13/cobra"
	_ "github.com/stretchr/testify/require"
	_ "github.com/vmihailenco/msgpack/v5"
	_ "go.uber.org/goleak"
	_ "go.uber.org/zap"
	_ "go.uber.org/zap/exp/zapslog"
	_ "gonum.org/v1/plot"
	_ "pgregory.net/rapid"
)

func main() {}
