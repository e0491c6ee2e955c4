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
	// A name that is no benchmark is an error, not the help and status 0.
	Args: func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return fmt.Errorf("unknown benchmark %q (try: troupe bench --help)", args[0])
		}
		return nil
	},
	RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
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
