"""Figures and written reports of the analysis binaries: matplotlib figures (`plots`, with the shared colours of
`palette` and the axis logic of `figure_axes`), the sink-analysis report (`sink_report`), the sink-masking
report (`masking_report`) and the explorer page (`explorer_page`, with its `explorer_assets`)."""
