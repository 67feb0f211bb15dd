"""The dashboard: a Streamlit app (``app.py`` and its pages) over :mod:`dashboards.data`, its data layer.

:mod:`dashboards.data` needs no Streamlit; the pages do. ``trajflow dashboard`` serves the app.
"""
