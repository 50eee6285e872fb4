"""The plan pictures: the data a page draws and the page itself, shared by the service and the CLI.

The service serves the page (``static/``) at ``/ui`` and answers its JSON from ``data``;
``vbs show --html`` writes the same page as one self-contained file with the data embedded
(``page.render_page``), for a profile without a running service. Living in the planner
keeps the imports one way: the service reads these files, the planner never imports it.
"""
