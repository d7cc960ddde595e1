// The copy button of the reproduce command. Everything else on these pages works without a script.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const text = document.getElementById(button.dataset.copy).textContent;
  const status = button.parentElement.querySelector("[role=status]");
  try {
    await navigator.clipboard.writeText(text);
    status.textContent = "Copied.";
  } catch {
    // No clipboard permission (an http page, an old browser): select the text for Ctrl+C.
    const range = document.createRange();
    range.selectNodeContents(document.getElementById(button.dataset.copy));
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    status.textContent = "Selected: press Ctrl+C to copy.";
  }
});
