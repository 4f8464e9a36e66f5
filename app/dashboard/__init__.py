"""The live dashboard and chat playground served at `/` (`/ui`).

`recent.py` keeps what the HTTP side saw since the last tick (latencies, errors); `timeline.py` turns the
engine's stats snapshots and those into one sample a second, with 15 minutes of history; `feed.py` ticks it
and pushes each sample to the open dashboards; `routes.py` serves the page, its files and the push stream
(`static/`).

Charts are drawn by uPlot 1.6.32, vendored unmodified from the npm package `uplot` (its
`dist/uPlot.iife.min.js`, `dist/uPlot.min.css` and MIT `LICENSE`, in `static/vendor/`): no build step, no
CDN, works offline. To update: `npm pack uplot@VERSION` and copy those three files.
"""
