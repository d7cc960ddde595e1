"""What the API and the worker share: settings, schema, enums, queue names, Hub access, export."""
