"""The Textual dashboard (`kvprof top`). The only package that imports textual; the data it
shows comes ready-made from kvprof.views.snapshot."""
