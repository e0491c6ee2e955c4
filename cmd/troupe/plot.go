package main

import (
	"fmt"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/troupe-hpc/troupe/transport/perf"
)

// plotPingpong draws latency and bandwidth against message size, one above
// the other, into a PNG file.
func plotPingpong(path string, pts []perf.Point) error {
	lat, bw := make(plotter.XYs, len(pts)), make(plotter.XYs, len(pts))
	for i, p := range pts {
		lat[i] = plotter.XY{X: float64(p.Size), Y: p.LatUs}
		bw[i] = plotter.XY{X: float64(p.Size), Y: p.BwMBs}
	}
	mk := func(title, ylabel string, xy plotter.XYs) (*plot.Plot, error) {
		p := plot.New()
		p.Title.Text = title
		p.X.Label.Text = "message size (bytes)"
		p.Y.Label.Text = ylabel
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
		if err := plotutil.AddLinePoints(p, "troupe", xy); err != nil {
			return nil, err
		}
		return p, nil
	}
	pl, err := mk("one-way latency", "us", lat)
	if err != nil {
		return err
	}
	pb, err := mk("bandwidth (window 64)", "MB/s", bw)
	if err != nil {
		return err
	}
	img := vgimg.New(8*vg.Inch, 8*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadY: vg.Millimeter * 4}
	canvases := plot.Align([][]*plot.Plot{{pl}, {pb}}, tiles, dc)
	pl.Draw(canvases[0][0])
	pb.Draw(canvases[1][0])
	if err := savePNG(img, path); err != nil {
		return fmt.Errorf("writing plot %s: %w", path, err)
	}
	return nil
}
