"""Figures and written reports of the analysis binaries: matplotlib figures (`plots`), the sink-analysis
report (`sink_report`) and the sink-masking report (`masking_report`)."""
