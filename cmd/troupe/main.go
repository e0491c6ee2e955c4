// Command troupe is troupe's launcher and tool box: it runs jobs (troupe run),
// describes the machine (troupe info) and measures the runtime (troupe bench).
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// rootCmd is the top of the command tree; subcommands attach in init functions
// of their own files (run.go, info.go, bench_*.go).
var rootCmd = &cobra.Command{
	Use:           "troupe",
	Short:         "troupe: message-driven distributed programs over UCX",
	SilenceUsage:  true,
	SilenceErrors: true,
}

// benchCmd groups the OSU-style benchmarks; each benchmark adds itself with
// benchCmd.AddCommand in its own bench_*.go file.
var benchCmd = &cobra.Command{
	Use:   "bench",
	Short: "OSU-style benchmarks (pingpong, ddt, actor, noncontig, gpu, overlap)",
}

func init() {
	rootCmd.AddCommand(benchCmd)
}

func main() {
	if err := rootCmd.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "troupe:", err)
		os.Exit(1)
	}
}
