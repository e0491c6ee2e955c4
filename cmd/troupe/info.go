package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/metrics"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

var infoCmd = &cobra.Command{
	Use:   "info",
	Short: "Show the UCX version, transports and devices, the PMIx client, metrics and the GPU backend",
	Args:  cobra.NoArgs,
	RunE: func(cmd *cobra.Command, _ []string) error {
		out := cmd.OutOrStdout()
		fmt.Fprintf(out, "troupe\n  UCX library   %s\n", ucx.Version())
		if v := os.Getenv("UCX_TLS"); v != "" {
			fmt.Fprintf(out, "  UCX_TLS       %s\n", v)
		}
		ctx, err := ucx.NewContext(ucx.FeatureTag|ucx.FeatureRMA|ucx.FeatureAM|ucx.FeatureWakeup, nil)
		if err != nil {
			return fmt.Errorf("opening a UCX context: %w", err)
		}
		defer ctx.Close()
		fmt.Fprintln(out, "\nUCX transports and devices (ucp_context_print_info):")
		for _, line := range strings.Split(strings.TrimSpace(ctx.Info()), "\n") {
			fmt.Fprintln(out, "  "+line)
		}
		fmt.Fprintln(out, "\nJobs:")
		if lib, v, err := bootstrap.PMIxVersion(); err != nil {
			fmt.Fprintf(out, "  pmix          unavailable (mpirun and srun launches fail; troupe run works): %v\n", err)
		} else {
			fmt.Fprintf(out, "  pmix          %s %s (ranks started by mpirun or srun --mpi=pmix join through it)\n", lib, v)
		}
		if v := os.Getenv(metrics.AddrEnv); v != "" {
			fmt.Fprintf(out, "  metrics       %s=%s: rank r serves http://host:port+r/metrics\n", metrics.AddrEnv, v)
		} else {
			fmt.Fprintf(out, "  metrics       off (%s=host:port serves rank r's at port+r)\n", metrics.AddrEnv)
		}
		fmt.Fprintln(out, "\nGPU:")
		sys, err := gpu.Open()
		if err != nil {
			fmt.Fprintf(out, "  unavailable: %v\n", err)
			return nil
		}
		defer sys.Close()
		fmt.Fprintf(out, "  backend       %s (%s=auto|host|cuda)\n", sys.Backend(), gpu.EnvBackend)
		if err := gpu.CUDAAvailable(); err != nil {
			fmt.Fprintf(out, "  cuda          %v\n", err)
		}
		for _, d := range sys.Devices() {
			free, total, err := d.MemInfo()
			if err != nil {
				fmt.Fprintf(out, "  device %d      %s\n", d.Ordinal(), d.Name())
				continue
			}
			fmt.Fprintf(out, "  device %d      %s, %d MiB free of %d MiB\n", d.Ordinal(), d.Name(), free>>20, total>>20)
		}
		return nil
	},
}

func init() { rootCmd.AddCommand(infoCmd) }
