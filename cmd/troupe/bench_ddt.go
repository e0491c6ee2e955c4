package main

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/datatype/layouts"
)

// ddtCmd measures derived-datatype pack and unpack against copy on the
// DDTBench-style layouts of datatype/layouts.
var ddtCmd = &cobra.Command{
	Use:   "ddt",
	Short: "derived datatype pack/unpack bandwidth vs copy on the 13 DDTBench layouts",
	Args:  cobra.NoArgs,
	RunE:  runDDT,
}

func init() {
	ddtCmd.Flags().Bool("json", false, "print one JSON object per layout")
	ddtCmd.Flags().Duration("round", 60*time.Millisecond, "duration of one measurement round")
	ddtCmd.Flags().Int("rounds", 3, "rounds per measurement (best is reported)")
	ddtCmd.Flags().StringSlice("layout", nil, "layouts to run (default: all)")
	benchCmd.AddCommand(ddtCmd)
}

func runDDT(cmd *cobra.Command, _ []string) error {
	asJSON, _ := cmd.Flags().GetBool("json")
	round, _ := cmd.Flags().GetDuration("round")
	rounds, _ := cmd.Flags().GetInt("rounds")
	names, _ := cmd.Flags().GetStringSlice("layout")
	if len(names) == 0 {
		names = layouts.Names
	}
	out := cmd.OutOrStdout()
	var tw *tabwriter.Writer
	if !asJSON {
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "layout\tbytes\tpack GB/s\tunpack GB/s\tcopy GB/s\tpack/copy\tunpack/copy\t")
	}
	enc := json.NewEncoder(out)
	for _, name := range names {
		l, err := layouts.Build(name)
		if err != nil {
			return err
		}
		r, err := layouts.Measure(l, round, rounds)
		if err != nil {
			return err
		}
		if asJSON {
			if err := enc.Encode(r); err != nil {
				return err
			}
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t\n", r.Layout, r.Bytes,
			r.PackGBps, r.UnpackGBps, r.CopyGBps, r.PackGBps/r.CopyGBps, r.UnpackGBps/r.CopyGBps)
	}
	if tw != nil {
		return tw.Flush()
	}
	return nil
}
