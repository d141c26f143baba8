"""How one row of the conversation list is drawn: the title (elided to fit, never a horizontal
scroll bar), when it was last active on the right in a muted colour, and while searching a second
line with the matching words of the conversation highlighted."""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QRect, QSize, Qt
from PySide6.QtGui import QPainter, QPalette, QTextDocument
from PySide6.QtWidgets import QApplication, QStyle, QStyledItemDelegate, QStyleOptionViewItem

from app.conversations.highlight import HIGHLIGHT_BACKGROUND, highlight_html
from app.conversations.model import DATE_ROLE, SNIPPET_ROLE, TERMS_ROLE

PADDING = 4
GAP = 8  # between the title and the date


class ConversationDelegate(QStyledItemDelegate):
    def __init__(self, parent=None, dark: bool = False) -> None:
        super().__init__(parent)
        self.dark = dark

    def sizeHint(  # noqa: N802 (Qt naming)
        self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> QSize:
        lines = 2 if index.data(SNIPPET_ROLE) else 1
        return QSize(0, lines * option.fontMetrics.height() + 2 * PADDING)

    def paint(
        self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> None:
        opt = QStyleOptionViewItem(option)
        self.initStyleOption(opt, index)
        style = opt.widget.style() if opt.widget else QApplication.style()
        opt.text = ""
        style.drawPrimitive(QStyle.PrimitiveElement.PE_PanelItemViewItem, opt, painter, opt.widget)
        selected = bool(opt.state & QStyle.StateFlag.State_Selected)
        text_role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        rect = opt.rect.adjusted(PADDING, PADDING, -PADDING, -PADDING)
        line = opt.fontMetrics.height()
        date = index.data(DATE_ROLE) or ""
        date_width = opt.fontMetrics.horizontalAdvance(date)
        painter.save()
        painter.setFont(opt.font)
        muted = opt.palette.color(text_role)
        if not selected:
            muted = opt.palette.color(QPalette.ColorRole.PlaceholderText)
        painter.setPen(muted)
        painter.drawText(
            QRect(rect.right() - date_width, rect.top(), date_width, line),
            Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
            date,
        )
        title_room = max(0, rect.width() - date_width - GAP)
        title = opt.fontMetrics.elidedText(index.data() or "", Qt.TextElideMode.ElideRight, title_room)
        painter.setPen(opt.palette.color(text_role))
        painter.drawText(
            QRect(rect.left(), rect.top(), title_room, line), Qt.AlignmentFlag.AlignVCenter, title
        )
        snippet = index.data(SNIPPET_ROLE)
        if snippet:
            self._paint_snippet(
                painter, opt, QRect(rect.left(), rect.top() + line, rect.width(), line), index
            )
        painter.restore()

    def _paint_snippet(
        self,
        painter: QPainter,
        opt: QStyleOptionViewItem,
        rect: QRect,
        index: QModelIndex | QPersistentModelIndex,
    ) -> None:
        """The matching words, highlighted; one line, elided at the end."""
        metrics = opt.fontMetrics
        text = metrics.elidedText(
            " ".join((index.data(SNIPPET_ROLE) or "").split()), Qt.TextElideMode.ElideRight, rect.width()
        )
        doc = QTextDocument()
        doc.setDefaultFont(opt.font)
        doc.setDocumentMargin(0)
        colour = opt.palette.color(
            QPalette.ColorRole.HighlightedText
            if opt.state & QStyle.StateFlag.State_Selected
            else QPalette.ColorRole.PlaceholderText
        )
        terms = index.data(TERMS_ROLE) or []
        doc.setHtml(
            f'<span style="color:{colour.name()}; white-space:pre;">'
            f"{highlight_html(text, terms, HIGHLIGHT_BACKGROUND[self.dark])}</span>"
        )
        painter.translate(rect.topLeft())
        doc.drawContents(painter)
