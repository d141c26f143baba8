"""Trellis Chat, the desktop application (PySide6).

Why Qt Widgets and not Qt Quick
-------------------------------
We chose Widgets. The deciding points, for this app specifically:

- **Rich text is the product.** A chat reply is Markdown with code blocks, tables and math.
  ``QTextDocument``/``QTextBrowser`` render HTML-subset rich text, do selection, copy, find and
  link clicks out of the box, and can be re-rendered per message. Qt Quick's ``Text`` supports a
  smaller rich-text subset, and selection/copy across a rendered reply needs ``TextEdit`` plus
  custom work.
- **One language.** With Quick the UI would be QML + JavaScript glued to Python models by
  properties and slots; every feature would touch two languages and a binding layer. With Widgets
  the views, controllers and tests are all Python, and pytest-qt can drive real widgets
  (``qtbot.keyClicks``, ``mouseClick``) without QML object lookups by ``objectName`` strings.
- **Runs everywhere we need it.** Widgets render in software with no OpenGL/RHI requirement,
  which is what CI (``QT_QPA_PLATFORM=offscreen``), remote desktops and old GPUs give us. Quick
  needs a scene-graph backend and falls back to software rendering with caveats.
- **Desktop conventions for free.** Menus, shortcuts, native file dialogs, accessible names and
  the system palette (light/dark) come from the platform style without restyling every control.
- **Model/view fits.** Qt item models (``QAbstractListModel``) are shared by both toolkits, so
  the separation this app relies on (models mutated on the GUI thread, views that only display,
  controllers that connect) does not depend on the choice.

What we give up: fluid animations and a touch-first look, which a desktop chat client does not
need. The cost we pay instead is sizing each message's ``QTextBrowser`` to its content, done in
``app.chat.message_widget``.

Layout
------
``main_window`` composes panes; each pane is a package (``chat``, ``conversations``, ``library``,
``settings``); ``store`` persists everything in SQLite; ``worker`` is the only module that
talks to the engine, from its own ``QThread``.
"""
