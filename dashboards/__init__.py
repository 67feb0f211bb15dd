"""The dashboard: a Streamlit app (``app.py`` and its pages) over :mod:`trajflow.dashboards.data`, its data layer.

:mod:`trajflow.dashboards.data` needs no Streamlit; the pages do. ``trajflow dashboard`` serves the app.
"""
